"""Stale shared-memory segments of vLLM's CPU communicator, removed before they break a start.

On CPU, vLLM 0.25.1 moves tensor- and pipeline-parallel traffic through shared memory
(`vllm/distributed/device_communicators/cpu_communicator.py`, `_CPUSHMDistributed`): every rank
creates `/dev/shm/{port}-{group}-[{ranks}]-cpushm_{rank}`, where `port` is the engine's
distributed-init port (`VLLM_DIST_IDENT`, `vllm/v1/worker/cpu_worker.py`), with
`O_CREAT | O_EXCL`. A rank that ends without unlinking its segment (killed, or shut down before
its C++ destructor ran) leaves the file behind, and a later engine that draws the same port from
the kernel cannot start: its rank fails with `create shm in SHMManager failed. errno: 17`
(EEXIST) and vLLM reports only "Engine core initialization failed". (The project's CI of
2026-11-27 failed every TP=2 start that way, its root cause cut from the log; the machine then held
13 pairs of such files, two of them on ports two apart: the kernel's draws are not spread evenly.)

`sweep_stale_segments` removes such files when nothing can still use them: owned by this user,
mapped by no process, and their port listened on by nothing on this host (a starting engine's
distributed store listens on its port before any rank creates a segment, so a segment being
created is never taken for a stale one). The engine facade sweeps before it starts a multi-rank
CPU engine and after it closes one; after closing it first waits (bounded, `sweep_when_stale`) for
the segments its own start created to fall out of use: the ranks' processes may still be ending
when vLLM's shutdown returns, and a rank killed at the end of its shutdown grace leaves its
segment behind (seen in CI on a loaded machine).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_NAME = re.compile(r"^(?P<port>\d+)-.*-cpushm_\d+$")


def communicator_available() -> bool:
    """Whether vLLM's CPU build for this host has the shared-memory communicator at all. The
    AVX2 build (`vllm/_C_AVX2`, loaded on hosts without AVX-512) has no `init_shm_manager`: its
    ranks talk through torch.distributed (gloo) and create no segments (vLLM then logs "CPU SHM
    communicator disabled ... ranks do not share the same SHM group name")."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads the host's `_C` build)

    return hasattr(torch.ops._C, "init_shm_manager")


def _mapped_paths(proc: Path = Path("/proc")) -> set[str] | None:
    """Every file path mapped by a process of this user that can be read; None where /proc cannot
    be read at all (then nothing is known to be unused)."""
    try:
        pids = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return None
    uid = os.getuid()
    paths: set[str] = set()
    for pid in pids:
        try:
            if pid.stat().st_uid != uid:
                continue
            text = (pid / "maps").read_text()
        except OSError:  # the process ended, or its maps are not ours to read
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                paths.add(fields[5].removesuffix(" (deleted)"))
    return paths


def _listening_ports(proc: Path = Path("/proc")) -> set[int] | None:
    """TCP ports in LISTEN state on this host (IPv4 and IPv6); None where neither table can be read."""
    ports: set[int] = set()
    read_any = False
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # st == TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports if read_any else None


def segments(shm_dir: Path = SHM_DIR) -> set[Path]:
    """This user's CPU-communicator segments in `shm_dir` now (in use or not)."""
    uid = os.getuid()
    try:
        return {p for p in shm_dir.iterdir() if SEGMENT_NAME.match(p.name) and _owned_by(p, uid)}
    except OSError:
        return set()


def stale_segments(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> list[Path]:
    """The CPU-communicator segments in `shm_dir` that nothing can use any more (see the module's
    docstring); empty where the processes' maps or the listening ports cannot be read."""
    uid = os.getuid()
    try:  # each of this user's segments with its port
        candidates = {p: int(m["port"]) for p in shm_dir.iterdir()
                      if (m := SEGMENT_NAME.match(p.name)) and _owned_by(p, uid)}
    except OSError:
        return []
    if not candidates:
        return []
    mapped, listening = _mapped_paths(proc), _listening_ports(proc)
    if mapped is None or listening is None:
        return []
    return sorted(p for p, port in candidates.items() if str(p) not in mapped and port not in listening)


def _owned_by(path: Path, uid: int) -> bool:
    try:
        return path.stat().st_uid == uid
    except OSError:
        return False


def sweep_stale_segments(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> list[str]:
    """Remove the stale segments (`stale_segments`); returns the names removed (logged)."""
    removed = []
    for path in stale_segments(shm_dir, proc):
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    if removed:
        logger.info("removed %d stale shared-memory segment(s) of vLLM's CPU communicator left by ended engines: %s",
                    len(removed), ", ".join(removed))
    return removed


def sweep_when_stale(ours: Iterable[Path], timeout_s: float, shm_dir: Path = SHM_DIR, proc: Path = Path("/proc"),
                     poll_s: float = 0.1) -> list[str]:
    """Wait until each of `ours` (the segments an engine that is closing created) is gone or stale,
    at most `timeout_s`, then remove every stale segment; returns the names removed. Segments still
    in use at the deadline stay (the next start's sweep takes them once they are stale)."""
    pending = set(ours)
    deadline = time.monotonic() + timeout_s
    while True:
        pending = {p for p in pending if p.exists()}
        if not pending or time.monotonic() >= deadline:
            break
        if pending <= set(stale_segments(shm_dir, proc)):
            break
        time.sleep(poll_s)
    if pending - set(stale_segments(shm_dir, proc)):
        logger.info("shared-memory segment(s) of the closed engine still in use after %.0f s: %s",
                    timeout_s, ", ".join(sorted(p.name for p in pending)))
    return sweep_stale_segments(shm_dir, proc)
