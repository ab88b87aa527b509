"""`engine_ext.engine.cpu_shm`: which vLLM CPU-communicator segments count as stale (fast tier: a
fake /proc and /dev/shm in a temporary folder; the real start on a port with a stale segment is
in tests/test_multirank.py)."""

from __future__ import annotations

import os
import threading
import time

from engine_ext.engine.cpu_shm import segments, stale_segments, sweep_stale_segments, sweep_when_stale

TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def _fake_host(tmp_path, listening=(), mapped=()):
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    (proc / "net").mkdir(parents=True)
    rows = "".join(f"   0: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1\n"
                   for port in listening)
    established = "   1: 0100007F:BEEF 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 2\n"
    (proc / "net" / "tcp").write_text(TCP_HEADER + rows + established)
    pid = proc / "4242"
    pid.mkdir()
    (pid / "maps").write_text("".join(f"7f00-7f10 rw-s 00000000 00:1a 12 {shm / name}\n" for name in mapped)
                              + "7f10-7f20 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n")
    return shm, proc


def test_only_unmapped_segments_on_ports_nobody_listens_on_are_stale(tmp_path):
    names = {"41001-tp:0-[0-1]-cpushm_0": "stale",                  # nobody maps it, port free
             "41001-tp:0-[0-1]-cpushm_1": "stale",
             "41003-pp:0-[0-1]-cpushm_0": "mapped by a live rank",
             "41005-tp:0-[0-1]-cpushm_0": "port listened on (an engine starting)",
             "psm_0123abcd": "not vLLM's CPU communicator",
             "41007-tp:0-[0-1]-cpushm": "not the segment name pattern"}
    shm, proc = _fake_host(tmp_path, listening=[0xBEEF, 41005], mapped=["41003-pp:0-[0-1]-cpushm_0"])
    for name in names:
        (shm / name).write_bytes(b"\0" * 64)
    assert [p.name for p in stale_segments(shm, proc)] == ["41001-tp:0-[0-1]-cpushm_0", "41001-tp:0-[0-1]-cpushm_1"]
    assert sweep_stale_segments(shm, proc) == ["41001-tp:0-[0-1]-cpushm_0", "41001-tp:0-[0-1]-cpushm_1"]
    assert sorted(p.name for p in shm.iterdir()) == sorted(n for n, why in names.items() if why != "stale")


def test_nothing_is_removed_when_the_host_cannot_be_read(tmp_path):
    shm, proc = _fake_host(tmp_path)
    (shm / "41001-tp:0-[0-1]-cpushm_0").write_bytes(b"\0")
    os.remove(proc / "net" / "tcp")  # no port table: a starting engine could not be told apart
    assert stale_segments(shm, proc) == []
    assert sweep_stale_segments(shm, tmp_path / "no-proc") == []
    assert (shm / "41001-tp:0-[0-1]-cpushm_0").exists()


def test_after_close_the_sweep_waits_for_the_engines_own_segments_to_fall_out_of_use(tmp_path):
    """vLLM's shutdown can return while the ranks' processes are still ending (CI, a loaded machine:
    the closed engine's segments were still there): the sweep after close waits, bounded, for the
    segments its start created, then removes them; one still in use at the deadline stays."""
    shm, proc = _fake_host(tmp_path, mapped=["41001-tp:0-[0-1]-cpushm_0", "41001-tp:0-[0-1]-cpushm_1"])
    ours = [shm / "41001-tp:0-[0-1]-cpushm_0", shm / "41001-tp:0-[0-1]-cpushm_1"]
    for path in ours:
        path.write_bytes(b"\0" * 64)
    assert segments(shm) == set(ours) and stale_segments(shm, proc) == []

    started = time.monotonic()
    assert sweep_when_stale(ours, timeout_s=0.3, shm_dir=shm, proc=proc, poll_s=0.02) == []
    assert 0.3 <= time.monotonic() - started < 2.0 and all(p.exists() for p in ours), "removed while still mapped"

    ended = threading.Timer(0.3, lambda: (proc / "4242" / "maps").write_text(""))  # the ranks' processes end
    ended.start()
    started = time.monotonic()
    try:
        removed = sweep_when_stale(ours, timeout_s=20.0, shm_dir=shm, proc=proc, poll_s=0.02)
    finally:
        ended.join()
    assert removed == sorted(p.name for p in ours)
    assert 0.3 <= time.monotonic() - started < 5.0 and not any(p.exists() for p in ours)
    assert sweep_when_stale([], timeout_s=20.0, shm_dir=shm, proc=proc) == []  # nothing to wait for
