"""The engine client's handover of one P3 reply, lent against copied: a worker's capture ring (a
real `CaptureRing`, in this process) holds `--results` results of 16 layers x `--hidden` fp32
each, one after another in one region as one step's results lie; per round the client takes
the reply (`RingReaders.materialize_started`), converts every result as the engine loop does
(`outputs._intervention_result`: the 16 values of a result as rows of one array) and waits for
its copies (`copied()`); the previous round's results are dropped when the next round's are in
(a caller that keeps one batch at a time, as `cb_bench.py --tasks p3` does), and the slices
acknowledged then are released on the worker's side before the next round.

    PYTHONPATH=. python3 benchmarks/diag/ring_handover.py [--results 1000] [--hidden 2048] [--rounds 9]

Rounds alternate between the two modes (lent: `RingReaders(lend=True)`, copied: `lend=False`,
with the engine's copy threads); one JSON line per mode: the median ms per round and per result.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from engine_ext.capture_ring import CaptureRing, RingReaders
from engine_ext.collect_reply import expand_layouts, share_layouts
from engine_ext.engine.outputs import _intervention_result

LAYERS = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=int, default=1000)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    per = LAYERS * args.hidden * 4
    ring = CaptureRing(4 * args.results * per + (1 << 20))  # room for both modes' kept and new rounds (the engine's: 512 MiB)
    modes = {"lent": RingReaders(lend=True), "copied": RingReaders(lend=False)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    keys = [[layer * 4 + 3, 15] for layer in range(LAYERS)]  # [site, position] pairs, as the worker sends them
    try:
        for readers in modes.values():
            assert readers.open(ring.name) if readers is modes["lent"] else _share_map(readers, modes["lent"], ring.name)
        kept: dict[str, list] = {m: [] for m in modes}
        for rnd in range(args.rounds + 1):
            for mode, readers in modes.items():
                region = ring.alloc(args.results * per)
                assert region is not None, ring.status()
                ring.buffer(region, args.results * per)[:] = np.full(args.results * per // 4, rnd, "<f4").tobytes()
                reply = {f"k{i}": {"key": f"k{i}", "status": "ok",
                                   "captures": {"keys": keys, "ring": ring.share(region, i * per, per)}}
                         for i in range(args.results)}
                ring.deref(region)
                reply = share_layouts(reply)
                t0 = time.perf_counter()
                expand_layouts(reply)
                reply, copied = readers.materialize_started(reply)
                results = [_intervention_result(res, None) for res in reply.values()]
                copied()
                dt = time.perf_counter() - t0
                assert float(next(iter(results[-1].captures.values()))[0]) == rnd
                del reply
                kept[mode] = results  # the previous round's results dropped here
                del results
                for name, offs in readers.take_acks().items():
                    ring.release(offs)
                if rnd:  # the first is a warm-up
                    times[mode].append(dt)
        for mode, ts in times.items():
            ms = statistics.median(ts) * 1e3
            print(json.dumps({"bench": "ring_handover", "mode": mode, "results": args.results, "hidden": args.hidden,
                              "ms": round(ms, 2), "us_per_result": round(ms * 1e3 / args.results, 2),
                              "rounds_ms": [round(t * 1e3, 2) for t in ts], "readers": modes[mode].status()}))
    finally:
        kept.clear()
        for readers in modes.values():
            readers.close()
        ring.close()


def _share_map(readers: RingReaders, mapped: RingReaders, name: str) -> bool:
    """Give `readers` the mapping `mapped` already holds (the file is unlinked once mapped)."""
    readers._maps[name] = mapped._maps[name]
    if name in mapped._writable:
        readers._writable.add(name)
    return True


if __name__ == "__main__":
    main()
