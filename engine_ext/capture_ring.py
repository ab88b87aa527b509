"""Captured values handed from a worker to the engine client through shared memory.

With vLLM's engine core in its own process, a worker's `cb_collect` reply travels as a msgpack
message over a zmq socket: every captured value is copied into the message, through the socket,
out of it into a `bytes` object and once more into a writable array (P3 in docs/performance.md:
16 layers x 2048 fp32 = 128 KiB per prompt). With a ring (`CaptureRing`, one per worker, a
file in `/dev/shm`), the values are written there — on a GPU by the device-to-host copy of each
step's captured rows itself (the ring is registered as pinned memory), elsewhere by one copy —,
the reply carries `{"keys": ..., "ring": [name, offset, nbytes]}` instead of `"data"`, and the
client copies them once into its own writable buffer (`RingReaders.materialize`) and acknowledges
the slice with its next `cb_collect` call (`take_acks`).

Regions and slices: a region is allocated with one reference (its owner's: a step's rows, dropped
when that step's host copy is garbage; or a result's copy, dropped at once); every slice handed to
the client (`share`) adds one, dropped when the client acknowledges it (`release`). A region is
free once it has no reference left; allocation is next-fit (the first gap that holds it after the
newest region, else from the ring's start), so one region held long (a lent value a caller keeps)
holds only its own bytes.

Lending: the client may hand a reply's values to its callers as views of its mapping of the ring
instead of copies (`RingReaders`, while what it has lent of a ring stays within `LEND_SHARE` of it)
and acknowledges each run of them when the last value viewing it is garbage (`weakref.finalize`
on the run's array, which every view of it, numpy's or torch's, keeps alive). The worker writes a
region again only after every slice of it is acknowledged, so a lent value never changes under its
holder; a caller's writes into one touch only its own slice.

Contract:
* The ring only ever holds results already handed out or about to be; a full ring (a client that
  has not acknowledged, values callers keep lent, or results larger than the ring) makes the
  worker send the values inline, as without a ring, so nothing waits on the ring and no result is
  dropped. The client lends at most `LEND_SHARE` of a ring at once and copies beyond that.
* The file is created with `O_EXCL` and mode 0600, its space reserved with `posix_fallocate` (a
  full `/dev/shm` fails here, cleanly, instead of a SIGBUS at the first write), and unlinked by
  the client right after it maps it and by the worker when it closes: nothing stays in `/dev/shm`
  once both are gone.
* Only for a client on the same host as its workers (vLLM's multiprocess engine core and its `mp`
  executor); the engine enables it (`Engine.start`), an in-process engine needs none.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger("causalboard.capture_ring")

SHM_DIR = "/dev/shm"
#: regions start at multiples of this many bytes
ALIGN = 64
#: the bounds of a ring sized automatically (`auto_size`)
AUTO_MIN, AUTO_MAX = 64 << 20, 1 << 30


def auto_size(max_step_bytes: int) -> int:
    """A ring that holds two of the largest step's values (one still being read by the client,
    the next being written), within [64 MiB, 1 GiB]."""
    return int(min(AUTO_MAX, max(AUTO_MIN, 2 * max_step_bytes)))


_ids = itertools.count(1)

#: the share of a ring whose values the client may hold lent (handed to callers as views of the
#: ring, no copy) at once; a reply that would lend more is copied (`RingReaders`)
LEND_SHARE = 0.5


def lend_values() -> bool:
    """Whether the client lends ring-held values instead of copying them: `CAUSALBOARD_RING_LEND`
    (`0`: always copy), on by default."""
    return os.environ.get("CAUSALBOARD_RING_LEND", "1").strip() not in ("0", "false", "off", "")


#: a reply whose ring-held values reach this many bytes is copied out by several threads
#: (`RingReaders.materialize`; numpy releases the GIL while it copies)
PARALLEL_COPY_BYTES = 16 << 20

#: the client's copies of a reply's blocks are views of slabs of at most this many bytes, each
#: holding consecutive blocks (a larger block has a slab of its own): one allocation per slab
#: instead of one per block (numpy asks for transparent huge pages from 4 MiB on), and a value a
#: caller keeps holds at most one slab alive. `benchmarks/diag/ring_copyout.py`, P3's 1000 blocks
#: of 128 KiB: on the 2-core CPU 78 -> 35 ms (one thread) and 48 -> 24 ms (two); on an H200 host
#: (16 cores) 30 -> 23 ms with 4 threads, 19 -> 17 ms with 8
SLAB_BYTES = 8 << 20


def copy_threads() -> int:
    """The threads that copy a large reply out of a ring: `CAUSALBOARD_RING_COPY_THREADS`, else
    up to 8, leaving half the cores (a 2-core host: the calling thread alone)."""
    env = os.environ.get("CAUSALBOARD_RING_COPY_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def slab_views(sizes: list[int], where: list | None = None):
    """Uninitialised writable uint8 arrays of these sizes, in order: views of shared slabs of at
    most `SLAB_BYTES` (consecutive sizes packed together; a size of at least `SLAB_BYTES` alone).
    `where`: filled with each view's (slab, offset in it)."""
    import numpy as np

    out = []
    i = 0
    while i < len(sizes):
        j, total = i, 0
        while j < len(sizes) and (j == i or total + sizes[j] <= SLAB_BYTES):
            total += sizes[j]
            j += 1
        slab = np.empty(total, np.uint8)
        at = 0
        for n in sizes[i:j]:
            out.append(slab[at: at + n])
            if where is not None:
                where.append((slab, at))
            at += n
        i = j
    return out


def copy_runs(jobs: list[tuple[str, int, int]], where: list) -> list[tuple[str, int, Any, int, int]]:
    """The copies that move `jobs` (ring name, offset, bytes) into their places `where` (slab,
    offset in it), adjacent jobs merged: a job that starts in the same ring where the previous one
    ended, and lands in the same slab right after it, extends that copy. Each copy is (ring name,
    ring offset, slab, slab offset, bytes)."""
    runs: list[list] = []
    for (name, off, n), (slab, at) in zip(jobs, where):
        if not n:
            continue
        last = runs[-1] if runs else None
        if (last is not None and last[0] == name and last[1] + last[4] == off and last[2] is slab
                and last[3] + last[4] == at):
            last[4] += n
        else:
            runs.append([name, off, slab, at, n])
    return [tuple(r) for r in runs]

#: both sides map the ring with its page tables filled at once (Linux): a first touch of each
#: page would otherwise fault, once per 4 KiB, in the middle of the copies
#: (`benchmarks/diag/ring_populate.py`, 2-core CPU: P3's 131 MB of 128 KiB slices copied out in
#: 16-21 ms unpopulated, 8-12 ms populated; mapping 512 MiB populated takes 41-57 ms, once)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class CaptureRing:
    """A worker's ring: a shared-memory file of `size` bytes and a next-fit allocator over it
    (regions released in any order, each free once nothing references it)."""

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError("capture ring size must be positive")
        self.size = int(size)
        self.name = f"causalboard-ring-{os.getpid()}-{next(_ids)}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            self._unlink()
            raise
        os.close(fd)
        self._view = memoryview(self._map)
        #: where the newest region ends: the next allocation looks from here first
        self._head = 0
        #: live regions: offset -> [nbytes, references], and their offsets in order
        self._live: dict[int, list] = {}
        self._offs: list[int] = []
        #: slices handed out: slice offset -> its region's offset
        self._slices: dict[int, int] = {}
        self._tensor = None  # the whole ring as a torch uint8 tensor (`host_rows`)
        self.pinned = False
        #: allocations that found room / found none (then the values travel the usual way)
        self.allocs = 0
        self.full = 0

    @classmethod
    def create(cls, size: int) -> CaptureRing | None:
        """A ring of `size` bytes, or None (logged) where shared memory cannot hold it. Rings
        that ended processes left behind are removed first (`sweep_stale`)."""
        sweep_stale()
        try:
            st = os.statvfs(SHM_DIR)
            free = st.f_bavail * st.f_frsize
            if free < 2 * size:
                logger.info("capture ring off: %s has %d bytes free, %d wanted", SHM_DIR, free, 2 * size)
                return None
            return cls(size)
        except OSError as exc:
            logger.info("capture ring off: %s", exc)
            return None

    def status(self) -> dict:
        """Size, bytes in use, allocations that found room and that found none."""
        return {"bytes": self.size, "in_use": self.in_use, "allocs": self.allocs, "full": self.full,
                "pinned": self.pinned}

    @property
    def in_use(self) -> int:
        """Bytes of the live regions (allocated, not yet reusable)."""
        return sum(n for n, _ in self._live.values())

    def pin_for_cuda(self) -> bool:
        """Register the ring as page-locked memory with CUDA, so that device-to-host copies go
        straight into it without waiting (`host_rows`). False (logged) where that fails."""
        import numpy as np
        import torch

        ptr = int(np.frombuffer(self._map, dtype=np.uint8).ctypes.data)
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0)
        if int(err) != 0:
            logger.info("capture ring: cudaHostRegister failed (%s); values are copied into it instead", err)
            return False
        self._ptr, self.pinned = ptr, True
        return True

    def host_rows(self, offset: int, rows: int, cols: int):
        """Region bytes as a float32 [rows, cols] torch tensor sharing the ring's memory."""
        import torch

        if self._tensor is None:
            self._tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        return self._tensor[offset: offset + 4 * rows * cols].view(torch.float32).view(rows, cols)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new region of `nbytes` bytes, or None when the ring has no room."""
        off = self._alloc(max(ALIGN, -(-int(nbytes) // ALIGN) * ALIGN))
        if off is None:
            self.full += 1
        else:
            self.allocs += 1
        return off

    def _alloc(self, n: int) -> int | None:
        if n > self.size:
            return None
        if not self._live:
            self._head = 0
        off = self._gap(self._head, n)
        if off is None and self._head:
            off = self._gap(0, n)
        if off is None:
            return None
        bisect.insort(self._offs, off)
        self._head = off + n
        self._live[off] = [n, 1]
        return off

    def _gap(self, start: int, n: int) -> int | None:
        """The first offset at or after `start` where `n` bytes lie free, or None."""
        offs, live = self._offs, self._live
        i = bisect.bisect_right(offs, start)
        if i:
            prev = offs[i - 1]
            start = max(start, prev + live[prev][0])
        while True:
            nxt = offs[i] if i < len(offs) else self.size
            if start + n <= nxt:
                return start
            if i >= len(offs):
                return None
            start = max(start, offs[i] + live[offs[i]][0])
            i += 1

    def share(self, region: int, start: int, nbytes: int) -> list:
        """Hand bytes `[start, start + nbytes)` of a region to the client: its descriptor
        `[name, offset, nbytes]` (one more reference on the region until `release`)."""
        off = region + start
        if off in self._slices or region not in self._live:
            raise ValueError(f"capture ring {self.name}: slice {off} of region {region} is not free to share")
        self._slices[off] = region
        self._live[region][1] += 1
        return [self.name, off, int(nbytes)]

    def release(self, offsets) -> None:
        """The client is done with these slices (acknowledged; unknown offsets are ignored)."""
        for off in offsets:
            region = self._slices.pop(int(off), None)
            if region is not None:
                self.deref(region)

    def deref(self, region: int) -> None:
        """Drop one reference on a region; a region with none left is free."""
        rec = self._live.get(region)
        if rec is None:
            return
        if rec[1] > 0:
            rec[1] -= 1
        if not rec[1]:
            del self._live[region]
            del self._offs[bisect.bisect_left(self._offs, region)]

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """The writable bytes of a region."""
        return self._view[offset: offset + nbytes]

    def close(self) -> None:
        self._live.clear()
        self._offs.clear()
        self._slices.clear()
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self.pinned = False
        self._tensor = None
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a tensor still shares it: the mapping goes with the last reference
            logger.debug("capture ring %s still referenced at close", self.name)
        self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


#: a ring file older than this whose creating process is gone is a leftover (`sweep_stale`)
STALE_AFTER_S = 60.0


def sweep_stale(now: float | None = None) -> list[str]:
    """Remove ring files whose creating process (the pid in the name) no longer exists and that
    are older than `STALE_AFTER_S` (a worker killed before its client mapped the ring, which
    unlinks it, or before it closed it: otherwise the file would hold its memory in /dev/shm until
    the host restarts). Files of live processes, fresh ones and other users' are left alone.
    Returns the names removed."""
    import re
    import time

    now = time.time() if now is None else now
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        m = re.fullmatch(r"causalboard-ring-(\d+)-\d+", name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except OSError:  # another user's process, or not ours to ask: leave it
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if now - os.stat(path).st_mtime < STALE_AFTER_S:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    if removed:
        logger.info("removed %d capture ring(s) left in %s by ended processes: %s", len(removed), SHM_DIR, removed)
    return removed


def copied_already() -> None:
    """The `copied` of copies that are done (nothing left to wait for)."""


class RingReaders:
    """The client's side: the workers' rings by name (mapped), the regions read since the last
    `take_acks`, and what is lent (`LEND_SHARE`).

    Thread safety: `materialize_started`, `take_acks` and `close` run on one thread (the engine
    loop's); a lent run is given back (`_given_back`) on whichever thread drops its last value."""

    def __init__(self, lend: bool | None = None) -> None:
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}
        #: rings mapped writable (where lent values are ordinary writable arrays): the ones lent from
        self._writable: set[str] = set()
        self._acks: dict[str, list[int]] = {}
        #: bytes lent per ring and not yet given back
        self._lent: dict[str, int] = {}
        self._lock = threading.Lock()
        self.lend = lend_values() if lend is None else bool(lend)
        #: replies whose values were lent / copied (`status`)
        self.lent_replies = self.copied_replies = 0
        self.threads = copy_threads()
        self._pool: ThreadPoolExecutor | None = None

    def open(self, name: str) -> bool:
        """Map a worker's ring (writable where this process may: lent values are writable arrays;
        else read-only, and its values are always copied) and unlink its file (the mappings keep
        the memory). False if it cannot be opened here (another host, another mount namespace)."""
        if name in self._maps:
            return True
        path = os.path.join(SHM_DIR, name)
        writable = True
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            writable = False
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return False
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            m = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE, prot=prot)
        except OSError:
            return False
        finally:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        self._maps[name] = (m, memoryview(m))
        if writable:
            self._writable.add(name)
        return True

    def __bool__(self) -> bool:
        return bool(self._maps)

    def status(self) -> dict:
        """Bytes lent per ring, and the replies lent and copied so far."""
        with self._lock:
            lent = {n: b for n, b in self._lent.items() if b}
        return {"lend": self.lend, "lent_bytes": lent, "lent_replies": self.lent_replies,
                "copied_replies": self.copied_replies}

    def materialize(self, reply: dict[str, dict], copy: bool = True) -> dict[str, dict]:
        """`materialize_started`, its copies waited for."""
        reply, copied = self.materialize_started(reply, copy)
        copied()
        return reply

    def materialize_started(self, reply: dict[str, dict], copy: bool = True) -> tuple[dict[str, dict], Callable[[], None]]:
        """One worker's `cb_collect` reply with every ring-held capture block made the client's
        own (`"data"`: a writable uint8 numpy array): lent, where `lend` is on, the ring mapped
        writable and the reply keeps what is lent of each ring within `LEND_SHARE` of it (each
        block a view of its run of adjacent blocks in the ring, the run acknowledged once nothing
        views it: `_lend`); else copied into a slab shared with neighbouring blocks of the reply
        (`slab_views`; a reply of at least `PARALLEL_COPY_BYTES` by `threads` threads at once)
        and acknowledged. Returned with `copied`: the threads' copies may still run when this
        returns (every block's `"data"` is already its array); no value may be read before
        `copied()` has returned (lent values and the calling thread's own copies are in place).
        A slice this process cannot read (a ring it has not mapped, bounds outside the ring: a
        bug) voids that result, with the reason, instead of handing over wrong values.
        `copy=False` (a worker whose captures the client does not use: a tensor-parallel rank that
        does not lead its pipeline stage, `Topology.leaders`): every ring-held block is dropped
        from the reply (no `"captures"`), its slice acknowledged, nothing copied."""
        jobs: list[tuple[dict, str, int, int]] = []
        acks: list[tuple[str, int]] = []
        for res in reply.values():
            block = res.get("captures") if isinstance(res, dict) else None
            if not block or "ring" not in block:
                continue
            name, off, n = block.pop("ring")
            entry = self._maps.get(name)
            if not copy:
                del res["captures"]
                if entry is not None:
                    acks.append((name, off))
                continue
            if entry is None or off < 0 or n < 0 or off + n > len(entry[1]):
                block["keys"], block["data"] = [], bytearray()
                res["status"] = "voided"
                res["errors"] = list(res.get("errors") or []) + [
                    f"captured values lost: slice [{off}, {off + n}) of capture ring {name} cannot be read here"]
                continue
            jobs.append((block, name, off, n))
        if jobs and self._may_lend(jobs):
            self._acknowledge(acks)
            self._lend(jobs)
            self.lent_replies += 1
            return reply, copied_already
        self._acknowledge(acks + [(name, off) for _, name, off, _ in jobs])
        if not jobs:
            return reply, copied_already
        self.copied_replies += 1
        return reply, self._copy(jobs)

    def _acknowledge(self, slices: list[tuple[str, int]]) -> None:
        if slices:
            with self._lock:
                for name, off in slices:
                    self._acks.setdefault(name, []).append(off)

    def _may_lend(self, jobs: list[tuple[dict, str, int, int]]) -> bool:
        if not self.lend:
            return False
        want: dict[str, int] = {}
        for _, name, _, n in jobs:
            if name not in self._writable:
                return False
            want[name] = want.get(name, 0) + n
        with self._lock:
            return all(self._lent.get(name, 0) + n <= LEND_SHARE * len(self._maps[name][1]) for name, n in want.items())

    def _lend(self, jobs: list[tuple[dict, str, int, int]]) -> None:
        """Each block's `"data"` a view of the ring: blocks adjacent in one ring share one array
        (a run), given back (`_given_back`: acknowledged, no longer counted as lent) when the
        last value viewing it is garbage."""
        import numpy as np

        runs: list[list] = []  # [ring name, start, end, [(block, offset, bytes)]]
        for block, name, off, n in jobs:
            last = runs[-1] if runs else None
            if last is not None and last[0] == name and last[2] == off:
                last[2] = off + n
            else:
                last = [name, off, off + n, []]
                runs.append(last)
            last[3].append((block, off, n))
        for name, start, end, blocks in runs:
            base = np.frombuffer(self._maps[name][1], np.uint8, end - start, start)
            for block, off, n in blocks:
                block["data"] = base[off - start: off - start + n]
            with self._lock:
                self._lent[name] = self._lent.get(name, 0) + (end - start)
            weakref.finalize(base, self._given_back, name, [off for _, off, _ in blocks], end - start)

    def _given_back(self, name: str, offsets: list[int], nbytes: int) -> None:
        with self._lock:
            self._acks.setdefault(name, []).extend(offsets)
            self._lent[name] = self._lent.get(name, 0) - nbytes

    def _copy(self, jobs: list[tuple[dict, str, int, int]]) -> Callable[[], None]:
        """Each block's bytes into its own range of a slab (`slab_views`), adjacent blocks with
        one copy (`copy_runs`: the blocks of one step's results lie one after the other in the
        ring, so a slab's worth usually moves at once, and a copying thread takes the GIL back
        once per slab instead of once per block); the copies shared out over the threads for a
        reply of at least `PARALLEL_COPY_BYTES`. Returns what waits for the copies."""
        import numpy as np

        where: list = []
        dst = slab_views([n for *_, n in jobs], where)
        runs = copy_runs([(name, off, n) for _, name, off, n in jobs], where)
        maps = self._maps

        def part(i: int, k: int) -> None:
            for j in range(i, len(runs), k):
                name, off, slab, at, n = runs[j]
                np.copyto(slab[at: at + n], np.frombuffer(maps[name][1], np.uint8, n, off))

        k = min(self.threads, len(runs)) if sum(len(d) for d in dst) >= PARALLEL_COPY_BYTES else 1
        for (block, *_), d in zip(jobs, dst):
            block["data"] = d
        if k <= 1:
            part(0, 1)
            return copied_already
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="cb-ring-copy")
        futures = [self._pool.submit(part, i, k) for i in range(k)]

        def copied() -> None:
            for f in futures:
                f.result()
        return copied

    def take_acks(self) -> dict[str, list[int]]:
        """The regions read since the last call, by ring (sent with the next `cb_collect`)."""
        with self._lock:
            acks, self._acks = self._acks, {}
        return acks

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for m, view in self._maps.values():
            try:
                view.release()
                m.close()
            except BufferError:  # lent values still view it: the mapping goes with the last of them
                logger.debug("a capture ring mapping is still viewed by lent values at close")
        self._maps.clear()
        self._writable.clear()
