"""GPU validation and throughput of patch sweeps through the real HTTP API (uvicorn in-process).

Run on the GPU host after `source .vbundle/gpu_env.sh` (uvicorn is not on the host: carry a copy,
e.g. `.gpu_extra/uvicorn` copied from the project venv, and add `.gpu_extra` to PYTHONPATH),
one configuration per process:

    python3 benchmarks/gpu_sweep.py --model llama-1b --mode graphs --runner v2 --out $OUT/sweep-1b-graphs-v2.json
    python3 benchmarks/gpu_sweep.py --model bundled --mode eager --runner v1 --out $OUT/sweep-bundled-eager-v1.json

Checks (each recorded with its numbers):
* recovered sweep, all layers x all positions, post_block: the last layer at the last position
  recovers exactly 1.0 (bit-exact restore); noise floor reported;
* pre_attn of layer L+1 equals post_block of layer L (same stream) within the noise floor;
* two concurrent sweeps equal their solo runs within the noise floor;
* zoom (source_run kept by the first sweep) equals the coarse sweep's cells within the floor;
* a client disconnect mid-stream leaves no request in flight and no lease;
* bundled model only: the model card's trace structure (noise sweeps over 8 facts).
Throughput: cells/s of a large single-hook sweep and of a noise sweep (samples=4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _plain(x):
    """numpy scalars -> Python scalars (for json)."""
    return x.item() if hasattr(x, "item") else str(x)


def _serve(engine):
    from benchmarks.serve_api import serve_in_thread

    url, server, _ = serve_in_thread(engine)
    return url, server


def _bodies(model: str, eng) -> dict:
    if model == "bundled":
        from engine_ext import BUNDLED_MODEL_PATH

        tasks = json.loads((BUNDLED_MODEL_PATH / "tasks.json").read_text())
        pairs = [p for p in tasks["pairs"] if p["equal_length"]]
        mk = lambda p: {"prompt": p["corrupt_prompt"], "clean_prompt": p["clean_prompt"],  # noqa: E731
                        "answer_token_id": p["answer_id"], "foil_token_id": p["foil_id"]}
        long_prompt = " ".join([pairs[0]["corrupt_prompt"]] * 12)
        return {"pair": mk(pairs[0]), "pair2": mk(pairs[1]), "facts": tasks["facts"], "tasks": tasks,
                "big": {"prompt": long_prompt, "clean_prompt": long_prompt.replace(pairs[0]["corrupt_prompt"].split()[0],
                                                                                pairs[0]["clean_prompt"].split()[0]),
                        "answer_token_id": pairs[0]["answer_id"], "foil_token_id": pairs[0]["foil_id"]}}
    words = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731  (synthetic word-level tokenizer)
    base = [100 + 37 * i % 5000 for i in range(23)]
    corrupt = list(base)
    corrupt[5:8] = [9001, 9002, 9003]
    base2 = [300 + 11 * i % 7000 for i in range(23)]
    corrupt2 = list(base2)
    corrupt2[3:5] = [9101, 9102]
    big = [500 + 13 * i % 9000 for i in range(63)]
    big_c = list(big)
    big_c[10:14] = [9201, 9202, 9203, 9204]
    mk = lambda c, k: {"prompt": words(c), "clean_prompt": words(k), "answer_token": "t11", "foil_token": "t12"}  # noqa: E731
    return {"pair": mk(corrupt, base), "pair2": mk(corrupt2, base2), "big": mk(big_c, big), "facts": None, "noise_span": "t9001 t9002 t9003"}


def run(args, eng=None, *, checks: bool = True, throughput: bool = True) -> dict:
    """The sweep checks and/or throughput through the HTTP API on `eng` (started here from `args`
    when None, and closed at the end). The recovered and logprob grids are kept under `values`
    for comparing configurations (benchmarks/gpu_multirank.py)."""
    import httpx
    import numpy as np

    from benchmarks.gpu_validate import _model_path
    from engine_ext import Engine
    from training.trace_structure import has_model_card_structure, mean_by_category, sweep_trace_facts

    res: dict = {"model": args.model, "mode": args.mode, "runner": args.runner, "batch_invariant": args.batch_invariant,
                 "checks": {}, "throughput": {}, "values": {}}
    t0 = time.perf_counter()
    own = eng is None
    if own:
        eng = Engine(model=_model_path(args.model, args.scratch), device=args.device,
                     enforce_eager=args.mode == "eager" or args.device == "cpu",
                     max_model_len=None if args.model == "bundled" else 512, gpu_memory_utilization=0.45,
                     source_store_bytes=512 * 1024 * 1024,
                     batch_invariant=args.batch_invariant if args.device == "cuda" else None).start()
    res["startup_s"] = round(time.perf_counter() - t0, 1)
    res["runner_class"] = eng.info.runner
    url, server = _serve(eng)
    http = httpx.Client(base_url=url, timeout=600)
    B = _bodies(args.model, eng)

    def sweep(**body):
        r = http.post("/v1/patch_sweep", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        return r.json()

    def grid(res_, hook=None):
        g = next((x["grid"] for x in (res_["hook_grids"] or []) if x["hook"] == hook), res_["grid"])
        return np.array(g, dtype=float)

    def check(name, fn):
        try:
            out = json.loads(json.dumps(fn(), default=_plain))
            res["checks"][name] = out
        except Exception as exc:
            res["checks"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
        print(json.dumps({name: res["checks"][name]})[:600], flush=True)

    sweep(**B["pair"], layers=[0], positions=[1])  # warm-up

    def recovered():
        r = sweep(**B["pair"], metric="recovered")
        g = grid(r)
        res["values"]["recovered"] = {"grid": g.tolist(), "noise_floor": r["noise_floor"], "clean": r["clean"],
                                      "corrupt": r["corrupt"]}
        return {"ok": g[-1, -1] == 1.0, "last_layer_last_pos": g[-1, -1], "noise_floor": r["noise_floor"],
                "cells": r["cells_done"], "elapsed_s": r["elapsed_s"], "clean": r["clean"], "corrupt": r["corrupt"],
                "checksum": r["checksum"]["consistent"], "within_noise": len(r["within_noise"])}

    def same_stream():
        r = sweep(**B["pair"], metric="logprob", hooks=["pre_attn", "post_block"])
        res["values"]["logprob_2_hooks"] = {"grids": {h: grid(r, h).tolist() for h in r["hooks"]},
                                            "noise_floor": r["noise_floor"]}
        d = float(np.nanmax(np.abs(grid(r, "pre_attn")[1:] - grid(r, "post_block")[:-1])))
        return {"ok": d <= 2 * r["noise_floor"] + 1e-6, "max_abs_diff_logprob": d, "noise_floor": r["noise_floor"]}

    def concurrent():
        a, b = dict(B["pair"], metric="logprob"), dict(B["pair2"], metric="logprob", hooks=["post_attn", "post_block"])

        async def go(bodies):
            async with httpx.AsyncClient(base_url=url, timeout=600) as c:
                return [x.json() for x in await asyncio.gather(*(c.post("/v1/patch_sweep", json=bd) for bd in bodies))]

        sa, = asyncio.run(go([a]))
        sb, = asyncio.run(go([b]))
        ca, cb = asyncio.run(go([a, b]))
        out = {"ok": True}
        for name, s, c in (("a", sa, ca), ("b", sb, cb)):
            # two measurements, each within its noise floor of the noise-free value
            floor = s["noise_floor"] + c["noise_floor"]
            d = max(float(np.nanmax(np.abs(grid(s, h) - grid(c, h)))) for h in s["hooks"])
            out[name] = {"max_abs_diff": d, "noise_floor_solo": s["noise_floor"], "noise_floor_concurrent": c["noise_floor"],
                         "within_max_floor": d <= max(s["noise_floor"], c["noise_floor"]) + 1e-6}
            out["ok"] &= d <= floor + 1e-6
        return out

    def zoom():
        coarse = sweep(**B["pair"], metric="recovered", keep_source=True)
        run_id = coarse["captured_source_run"]
        pos = coarse["positions"][-3:]
        z = sweep(**B["pair"], metric="recovered", source_run=run_id, layers=[0, 1], positions=pos)
        d = float(np.nanmax(np.abs(grid(z) - grid(coarse)[0:2, -3:])))
        eng.drop_source(run_id)
        return {"ok": (not z["auto_captured"]) and d <= coarse["noise_floor"] + z["noise_floor"] + 1e-6, "max_abs_diff": d,
                "noise_floors": [coarse["noise_floor"], z["noise_floor"]]}

    def disconnect():
        body = dict(B["big"], metric="logprob", hooks=["pre_attn", "post_attn", "post_block"], max_concurrency=4, stream=True)
        n, sid = 0, None
        with http.stream("POST", "/v1/patch_sweep", json=body) as r:
            for line in r.iter_lines():
                if line.startswith('data: {"type":"start"'):
                    sid = json.loads(line[6:])["sweep_id"]
                if line.startswith('data: {"type":"cell"'):
                    n += 1
                    if n >= 5:
                        break
        deadline = time.time() + 30
        while time.time() < deadline and http.get(f"/v1/patch_sweep/{sid}").json().get("cancelled") is None:
            time.sleep(0.05)
        summary = http.get(f"/v1/patch_sweep/{sid}").json()
        usage = eng.source_store_usage()
        return {"ok": eng.in_flight == 0 and all(x["leases"] == 0 for x in usage["runs"]) and not usage["runs"]
                and summary.get("cancelled") is True,
                "in_flight_after": eng.in_flight, "cells_done": summary.get("cells_done"), "cells_total": summary.get("cells_total"), "runs_left": [x["run_id"] for x in usage["runs"]]}

    def prefix_reuse_exact():
        """A sweep whose cells read the corrupt prompt's cached KV below their position
        (`prefix_reuse`) against the same sweep computed from scratch: with batch invariance on,
        equal as floats (pairs and noise corruption); off, within the two noise floors."""
        out, ok = {"batch_invariant": eng.info.batch_invariant}, True
        bodies = (("pair_3_hooks", dict(B["big"], metric="logprob", hooks=["pre_attn", "post_attn", "post_block"])),
                  ("noise_2_samples", dict(B["big"], clean_prompt=None, metric="logprob",
                                           noise={"positions": [34, 35, 36, 37], "samples": 2})))  # past a block
        for label, body in bodies:
            on, off = sweep(**body, prefix_reuse=True), sweep(**body, prefix_reuse=False)
            d = max(float(np.nanmax(np.abs(grid(on, h) - grid(off, h)))) for h in on["hooks"])
            equal = all(np.array_equal(grid(on, h), grid(off, h), equal_nan=True) for h in on["hooks"])
            floor = on["noise_floor"] + off["noise_floor"]
            good = (equal and on["corrupt"] == off["corrupt"]) if eng.info.batch_invariant else d <= floor + 1e-6
            out[label] = {"grids_equal": equal, "max_abs_diff": d, "noise_floors": [on["noise_floor"], off["noise_floor"]],
                          "cells": on["cells_done"], "reused_prompt_tokens": [on["reused_prompt_tokens"], off["reused_prompt_tokens"]],
                          "prefix_reuse": [on["prefix_reuse"], off["prefix_reuse"]]}
            ok &= good and on["reused_prompt_tokens"] > 0 and off["reused_prompt_tokens"] == 0
        return {"ok": ok, **out}

    def trace_structure():
        facts = sweep_trace_facts(B["facts"], lambda prompt: len(eng.tokenize(prompt)))
        mean = mean_by_category(
            (grid(sweep(prompt=f["prompt"], noise={"span": f["subject"], "samples": 4}, answer_token_id=f["answer_id"],
                        metric="recovered", recovered_basis="prob")), f["subject_span"]) for f in facts)
        return {"ok": has_model_card_structure(mean),
                "mean_recovered_by_layer": {k: v.round(3).tolist() for k, v in mean.items()}, "prompts": len(facts)}

    if checks:
        check("recovered_exact_restore", recovered)
        check("pre_attn_equals_previous_post_block", same_stream)
        check("concurrent_equals_solo", concurrent)
        check("zoom_reuses_source", zoom)
        check("disconnect_cancels", disconnect)
        check("prefix_reuse_exact", prefix_reuse_exact)
        if args.model == "bundled":
            check("trace_structure", trace_structure)

    for label, body in () if not throughput else (("big_post_block", dict(B["big"], metric="logprob")),
                        ("big_3_hooks", dict(B["big"], metric="logprob", hooks=["pre_attn", "post_attn", "post_block"])),
                        ("noise_4_samples", dict(B["big"], clean_prompt=None, metric="logprob",
                                                 noise={"positions": [10, 11, 12, 13], "samples": 4}))):
        try:
            t = time.perf_counter()
            r = sweep(**body, max_concurrency=256)
            dt = time.perf_counter() - t
            res["throughput"][label] = {"cells": r["cells_done"], "requests": r["cells_done"] * (4 if "noise" in label else 1),
                                        "wall_s": round(dt, 3), "cells_per_s": round(r["cells_done"] / dt, 1),
                                        "prompt_tokens": len(r["prompt_token_ids"]), "noise_floor": r["noise_floor"]}
        except Exception as exc:
            res["throughput"][label] = {"error": str(exc)}
        print(json.dumps({label: res["throughput"][label]}), flush=True)
    res["all_ok"] = all(c.get("ok") for c in res["checks"].values())
    http.close()
    server.should_exit = True
    if own:
        eng.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["bundled", "llama-1b"], default="bundled")
    ap.add_argument("--mode", choices=["eager", "graphs"], default="graphs")
    ap.add_argument("--runner", choices=["v1", "v2"], default="v2")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--scratch", default=os.environ.get("CB_SCRATCH", "/tmp"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.runner == "v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=2, default=_plain))
    print(json.dumps({"summary": {"all_ok": res["all_ok"], "startup_s": res["startup_s"]}}), flush=True)
    return 0 if res["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
