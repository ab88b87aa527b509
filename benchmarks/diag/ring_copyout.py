"""How fast the engine client can copy P3's captured values out of a capture ring
(`RingReaders.materialize`): 1000 slices of 128 KiB (16 layers x 2048 fp32 per prompt) from a
populated shared-memory mapping into buffers of the client's own, one round at a time with the
previous round's copies dropped (as a client that consumed them), per method:

* `bytearray`: `bytearray(view[off:off + n])` per slice on the calling thread (the current path);
* `numpy-N`: an uninitialised `np.empty(n, uint8)` per slice and `np.copyto` from the mapping,
  the slices split over N threads (numpy releases the GIL while it copies);
* `slab-N`: one uninitialised array for the whole round, each slice a view of it (one allocation:
  its pages are faulted in by the copy itself), N threads;
* `chunk-N`: slabs of at most 8 MiB (a kept value holds one slab, not the round's), N threads;
* `runs-N`: the same slabs, adjacent slices moved with one copy per slab
  (`engine_ext.capture_ring.copy_runs`, what `RingReaders` does), N threads;
* `mmap-N`: the slab as an anonymous mapping of its own, its pages filled at once (`MAP_POPULATE`:
  the kernel zeroes them in one call instead of one fault per 4 KiB page), N threads;
* `warm-N`: the same slab allocated and touched once before the rounds and reused (no page faults:
  the copy's bandwidth alone; not a method a client could use as such, the bound of the others).

    python3 benchmarks/diag/ring_copyout.py [--slices 1000] [--kib 128] [--rounds 7] [--threads 1,2,4] [--busy]

`--busy`: another thread runs Python code all the while (as the engine loop's thread converts
results while the readers' threads copy: `EngineLoop._deliver_collected`), so a copying thread
that needs the GIL between its copies waits for it.

One JSON line per method: the median ms per round and GB/s.
"""
import argparse
import json
import mmap
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _spin(stop: threading.Event) -> None:
    """Pure Python work until stopped (holds the GIL but for the interpreter's switches)."""
    while not stop.is_set():
        sum(range(2000))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slices", type=int, default=1000)
    ap.add_argument("--kib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", default="1,2,4")
    ap.add_argument("--busy", action="store_true")
    args = ap.parse_args()
    n = args.kib << 10
    size = n * args.slices
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        os.unlink(path)
    view = memoryview(m)
    np.frombuffer(view, np.uint8)[:] = np.random.default_rng(0).integers(0, 255, size, np.uint8)
    offs = list(range(0, size, n))

    def by_bytearray():
        return [bytearray(view[o: o + n]) for o in offs]

    def copy_into(dst, pool, k):
        """Slice j of the mapping into `dst[j]`, the slices split over k threads (pool None: one)."""
        def part(i):
            for j in range(i, len(offs), k):
                np.copyto(dst[j], np.frombuffer(view, np.uint8, n, offs[j]))
        if pool is None:
            part(0)
        else:
            list(pool.map(part, range(k)))
        return dst

    def by_numpy(pool, k):
        return copy_into([np.empty(n, np.uint8) for _ in offs], pool, k)

    def populated():
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        return np.frombuffer(mm, np.uint8)

    def by_chunks(pool, k, chunk=8 << 20):
        per = max(1, chunk // n)  # slices per slab
        slabs = [np.empty(n * min(per, len(offs) - i), np.uint8) for i in range(0, len(offs), per)]
        return copy_into([slabs[j // per][(j % per) * n: (j % per + 1) * n] for j in range(len(offs))], pool, k)

    def by_runs(pool, k):
        from engine_ext.capture_ring import copy_runs, slab_views

        where: list = []
        dst = slab_views([n] * len(offs), where)
        runs = copy_runs([("ring", o, n) for o in offs], where)

        def part(i):
            for j in range(i, len(runs), k):
                _, off, slab, at, cnt = runs[j]
                np.copyto(slab[at: at + cnt], np.frombuffer(view, np.uint8, cnt, off))
        if pool is None:
            part(0)
        else:
            list(pool.map(part, range(k)))
        return dst

    def by_slab(pool, k, slab=None):
        dst = np.empty(size, np.uint8) if slab is None else populated() if isinstance(slab, str) else slab
        return copy_into([dst[o: o + n] for o in offs], pool, k)

    methods = {"bytearray": lambda: by_bytearray()}
    pools = []
    for k in [int(x) for x in args.threads.split(",")]:
        pool = None if k == 1 else ThreadPoolExecutor(k)
        pools.append(pool)
        methods[f"numpy-{k}"] = (lambda pool=pool, k=k: by_numpy(pool, k))
        methods[f"slab-{k}"] = (lambda pool=pool, k=k: by_slab(pool, k))
        methods[f"chunk-{k}"] = (lambda pool=pool, k=k: by_chunks(pool, k))
        methods[f"runs-{k}"] = (lambda pool=pool, k=k: by_runs(pool, k))
        methods[f"mmap-{k}"] = (lambda pool=pool, k=k: by_slab(pool, k, "mmap"))
        warm = np.ones(size, np.uint8)
        methods[f"warm-{k}"] = (lambda pool=pool, k=k, warm=warm: by_slab(pool, k, warm))
    times = {name: [] for name in methods}
    _kept = None
    for _ in range(args.rounds):
        for name, fn in methods.items():
            _kept = None  # the last round's copies dropped, as a client that consumed them
            stop = threading.Event()
            busy = threading.Thread(target=_spin, args=(stop,)) if args.busy else None
            if busy is not None:
                busy.start()
            t = time.perf_counter()
            _kept = fn()
            times[name].append(time.perf_counter() - t)
            stop.set()
            if busy is not None:
                busy.join()
    ref = by_bytearray()
    for name, fn in methods.items():
        assert all(bytes(a) == bytes(b) for a, b in zip(ref, fn())), f"{name} copied wrong bytes"
    for name, ts in times.items():
        med = statistics.median(ts[1:] or ts)
        print(json.dumps({"bench": "ring_copyout", "method": name, "slices": args.slices, "kib": args.kib, "busy": args.busy,
                          "ms": round(1e3 * med, 2), "gb_s": round(size / med / 1e9, 2)}), flush=True)
    for pool in pools:
        if pool is not None:
            pool.shutdown()
    view.release()
    m.close()


if __name__ == "__main__":
    main()
