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
CPU engine and after it closes one.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_NAME = re.compile(r"^(?P<port>\d+)-.*-cpushm_\d+$")


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
