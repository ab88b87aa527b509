"""What filling a capture ring's page tables at mapping time (`MAP_POPULATE`,
`engine_ext.capture_ring`) saves the client: a writer touches every page of a shared-memory file
(as the worker's writes do), then a reader maps it read-only, with and without `MAP_POPULATE`, and
copies P3's values out of it (`--results` slices of 16 layers x 2048 fp32 = 128 KiB each, one
`bytearray` per slice as `RingReaders.materialize` does). Alternating rounds; one JSON line each.

    python3 benchmarks/diag/ring_populate.py [--ring-mib 512] [--results 1000] [--rounds 3]
"""
import argparse
import json
import mmap
import os
import time


def read_once(path: str, populate: bool, results: int, nbytes: int) -> tuple[float, float]:
    fd = os.open(path, os.O_RDONLY)
    t0 = time.perf_counter()
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    m = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ)
    t1 = time.perf_counter()
    os.close(fd)
    view = memoryview(m)
    t2 = time.perf_counter()
    for off in range(0, results * nbytes, nbytes):
        bytearray(view[off: off + nbytes])
    t3 = time.perf_counter()
    view.release()
    m.close()
    return (t1 - t0) * 1e3, (t3 - t2) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ring-mib", type=int, default=512)
    ap.add_argument("--results", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    size, nbytes = args.ring_mib << 20, 16 * 2048 * 4
    if args.results * nbytes > size:
        raise SystemExit("--results slices do not fit the ring")
    path = f"/dev/shm/causalboard-ring-populate-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        writer = mmap.mmap(fd, size)
        for i in range(0, size, mmap.PAGESIZE):
            writer[i] = 1
        for r in range(args.rounds):
            for populate in (False, True):
                map_ms, copy_ms = read_once(path, populate, args.results, nbytes)
                print(json.dumps({"bench": "ring_populate", "round": r, "populate": populate, "map_ms": round(map_ms, 1),
                                  "copy_ms": round(copy_ms, 1), "mb": round(args.results * nbytes / 1e6, 1)}), flush=True)
        writer.close()
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
