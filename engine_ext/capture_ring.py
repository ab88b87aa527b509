"""Captured values handed from a worker to the engine client through shared memory.

With vLLM's engine core in its own process, a worker's `cb_collect` reply travels as a msgpack
message over a zmq socket: every captured value is copied into the message, through the socket,
out of it into a `bytes` object and once more into a writable array (P3 in docs/performance.md:
16 layers x 2048 fp32 = 128 KiB per prompt). With a ring, the worker writes each result's values
once into a shared-memory file (`CaptureRing`, one per worker, in `/dev/shm`), the reply carries
`{"keys": ..., "ring": [name, offset, nbytes]}` instead of `"data"`, and the client copies them
once into its own writable buffer (`RingReaders.materialize`) and acknowledges the region with its
next `cb_collect` call (`take_acks`), after which the worker reuses it.

Contract:
* The ring only ever holds results already handed out or about to be; a full ring (a client that
  has not acknowledged, or results larger than the ring) makes the worker send the values inline,
  as without a ring, so nothing waits on the ring and no result is dropped.
* The file is created with `O_EXCL` and mode 0600, its space reserved with `posix_fallocate` (a
  full `/dev/shm` fails here, cleanly, instead of a SIGBUS at the first write), and unlinked by
  the client right after it maps it and by the worker when it closes: nothing stays in `/dev/shm`
  once both are gone.
* Only for a client on the same host as its workers (vLLM's multiprocess engine core and its `mp`
  executor); the engine enables it (`Engine.start`), an in-process engine needs none.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
from collections import OrderedDict

logger = logging.getLogger("causalboard.capture_ring")

SHM_DIR = "/dev/shm"
#: regions start at multiples of this many bytes
ALIGN = 64
_ids = itertools.count(1)


class CaptureRing:
    """A worker's ring: a shared-memory file of `size` bytes and a circular allocator over it
    (regions handed out in order, freed in any order, reused once every older one is free)."""

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError("capture ring size must be positive")
        self.size = int(size)
        self.name = f"causalboard-ring-{os.getpid()}-{next(_ids)}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)
            self._map = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            self._unlink()
            raise
        os.close(fd)
        self._view = memoryview(self._map)
        self._head = 0
        #: live regions in allocation order: offset -> [nbytes, freed]
        self._live: OrderedDict[int, list] = OrderedDict()

    @classmethod
    def create(cls, size: int) -> CaptureRing | None:
        """A ring of `size` bytes, or None (logged) where shared memory cannot hold it."""
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

    @property
    def in_use(self) -> int:
        """Bytes of the live regions (handed out, not yet freed)."""
        return sum(n for n, _ in self._live.values())

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new region of `nbytes` bytes, or None when the ring has no room."""
        n = max(ALIGN, -(-int(nbytes) // ALIGN) * ALIGN)
        if not self._live:
            self._head = 0
            if n > self.size:
                return None
            off = 0
        else:
            tail = next(iter(self._live))
            if self._head > tail:  # used: [tail, head); free: [head, size) and [0, tail)
                if self._head + n <= self.size:
                    off = self._head
                elif n < tail:
                    off = 0
                else:
                    return None
            elif self._head + n < tail:  # wrapped: used [tail, size) and [0, head); free: [head, tail)
                off = self._head
            else:
                return None
        self._head = off + n
        self._live[off] = [n, False]
        return off

    def free(self, offsets) -> None:
        """Give regions back (unknown offsets are ignored: acknowledged twice, or by another ring)."""
        for off in offsets:
            region = self._live.get(int(off))
            if region is not None:
                region[1] = True
        while self._live:
            off, (n, freed) = next(iter(self._live.items()))
            if not freed:
                break
            del self._live[off]

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """The writable bytes of a region."""
        return self._view[offset: offset + nbytes]

    def close(self) -> None:
        self._live.clear()
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a view still exported: the mapping goes with the last reference
            logger.debug("capture ring %s still referenced at close", self.name)
        self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class RingReaders:
    """The client's side: the workers' rings by name (mapped read-only), and the regions read
    since the last `take_acks`."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}
        self._acks: dict[str, list[int]] = {}

    def open(self, name: str) -> bool:
        """Map a worker's ring and unlink its file (the mappings keep the memory). False if it
        cannot be opened here (another host, another mount namespace)."""
        if name in self._maps:
            return True
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        except OSError:
            return False
        finally:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        self._maps[name] = (m, memoryview(m))
        return True

    def __bool__(self) -> bool:
        return bool(self._maps)

    def materialize(self, reply: dict[str, dict]) -> dict[str, dict]:
        """One worker's `cb_collect` reply with every ring-held capture block copied into a
        writable `bytearray` (`"data"`, as an inline block has it); the regions are acknowledged."""
        for res in reply.values():
            block = res.get("captures") if isinstance(res, dict) else None
            if not block or "ring" not in block:
                continue
            name, off, n = block.pop("ring")
            data = bytearray(n)
            entry = self._maps.get(name)
            if entry is None:  # never opened: a bug (the engine opens every ring it enables)
                raise RuntimeError(f"capture ring {name} is not mapped in this process")
            data[:] = entry[1][off: off + n]
            block["data"] = data
            self._acks.setdefault(name, []).append(off)
        return reply

    def take_acks(self) -> dict[str, list[int]]:
        """The regions read since the last call, by ring (sent with the next `cb_collect`)."""
        acks, self._acks = self._acks, {}
        return acks

    def close(self) -> None:
        for m, view in self._maps.values():
            view.release()
            m.close()
        self._maps.clear()
