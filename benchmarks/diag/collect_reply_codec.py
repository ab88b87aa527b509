"""A P3-sized `cb_collect` reply through vLLM's msgpack encoding, with every result's capture keys
(as before `collect_reply`) and with each layout's keys sent once (`share_layouts` on the worker,
`expand_layouts` on the client): encode (the engine core, between steps) and decode + expand
(the client), milliseconds per reply, medians.

    PYTHONPATH=. .venv/bin/python benchmarks/diag/collect_reply_codec.py [--results 1000] [--keys 16]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from engine_ext.collect_reply import expand_layouts, share_layouts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=int, default=1000)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    layout = [[3 * layer + 2, 15] for layer in range(args.keys)]
    reply = {f"k{i}": {"key": f"k{i}", "status": "ok", "errors": [],
                       "captures": {"keys": layout, "ring": ["/cb-ring", 4 * args.keys * 2048 * i, 4 * args.keys * 2048]}}
             for i in range(args.results)}
    enc, dec = MsgpackEncoder(), MsgpackDecoder(dict)
    out = {}
    for name, pack, unpack in (("every_result", lambda r: r, lambda r: r), ("once_per_layout", share_layouts, expand_layouts)):
        te, td, size = [], [], 0
        for _ in range(args.reps):
            r = copy.deepcopy(reply)
            for res in r.values():
                res["captures"]["keys"] = layout  # shared, as the worker's `_block_layout` keeps it
            t0 = time.perf_counter()
            wire = enc.encode(pack(r))
            t1 = time.perf_counter()
            unpack(dec.decode(wire))
            t2 = time.perf_counter()
            te.append(t1 - t0)
            td.append(t2 - t1)
            size = sum(len(b) for b in wire) if isinstance(wire, (list, tuple)) else len(wire)
        out[name] = {"encode_ms": round(statistics.median(te) * 1e3, 2), "decode_ms": round(statistics.median(td) * 1e3, 2),
                     "bytes": size}
    print(json.dumps({"bench": "collect_reply_codec", "results": args.results, "keys": args.keys, **out}))


if __name__ == "__main__":
    main()
