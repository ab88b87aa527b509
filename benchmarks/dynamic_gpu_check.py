#!/usr/bin/env python3
"""GPU check of dynamic steering (issue 15), for the lead: the CUDA path (compiled graphs, the
non-blocking scores copy decided at the next step's planning) takes exactly the decisions the
rule takes on the engine's own scores, at exactly the next position, for a batch of requests.

    PYTHONPATH=. python3 benchmarks/dynamic_gpu_check.py [--model DIR] [--device cuda]

For each of 16 prompts in one batch, with a threshold policy (hysteresis, min_hold 2) and a
proportional policy: replaying `PolicyState.decide` over the trace's scores must give the trace's
engaged flags and scales exactly; trace positions must run from the last prompt position, one per
generated token; the request must be 'ok'; the applied-action count must equal the engaged
positions; the checksums must be consistent. Also runs the same batch twice and requires
identical traces (the decisions do not depend on timing). Then the reference fork's declarative
gates (a host-probe `rest_of_request` gate and a soft `this_token` gate): replaying `GateState`
over each trace's scores gives its scales exactly, and two runs are identical. The `this_token`
gate is the op's row gate (on CUDA: the Triton kernel): at every position it acts, the reported
`g` must be `sigmoid(sharpness * (score - threshold))` of the reported in-graph score, and that
score must be the *pre-edit* value's projection, recomputed on the host from a capture of the
probe's site (post-edit value `v`, gated term `t`: `s = v - g * t`); the same check against the
post-edit value must fail (the term has a large component along the probe), so the check tells
the two apart. Prints one JSON line per check and exits 1 on a failure.

    PYTHONPATH=. python3 benchmarks/dynamic_gpu_check.py --device cpu --tokens 12   # the script on CPU
    VLLM_ENABLE_V1_MULTIPROCESSING=0 ... --device cpu --empty-steps   # + empty steps

`--empty-steps` (an in-process engine) runs, after every 5th step, what the seam does for an empty
step: vLLM's asynchronous scheduling (a GPU engine's default, off on the CPU platform) runs one
whenever every request of the batch has reached its last token, and such a step once took a chain
of repeated steps' pending decisions before the chain's bookkeeping (docs/validation.md).
"""
import argparse
import json
import sys


#: `--empty-steps`: an empty step after every this many steps (after every one, no chain of
#: repeated steps could form: each empty step takes the pending decisions)
EMPTY_EVERY = 5


def _empty_steps(eng) -> None:
    """After every `EMPTY_EVERY`-th `execute_model` of the in-process engine's runner, what the seam
    does for an empty step (asynchronous scheduling's, once every request of a batch has reached
    its last token): the schedule's registration and results (nothing in it) and `after_forward`.
    Inside chains of repeated steps and at their ends, as on a GPU."""
    from types import SimpleNamespace

    from engine_ext.worker import seam

    runner = eng._loop.engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    cls = type(runner)
    if not getattr(cls.execute_model, "_cb_wrapped", False):
        raise SystemExit("--empty-steps: the runner's execute_model is not causalboard's (an in-process engine is needed)")
    wrapped = cls.execute_model
    empty = SimpleNamespace(finished_req_ids=(), scheduled_new_reqs=())
    steps = [0]

    def execute_model(self, scheduler_output, *a, **k):
        out = wrapped(self, scheduler_output, *a, **k)
        steps[0] += 1
        state = seam.runner_state(self)
        if state is not None and steps[0] % EMPTY_EVERY == 0:
            state.on_schedule(empty)
            state.after_forward()
        return out

    runner.execute_model = execute_model.__get__(runner)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--empty-steps", action="store_true",
                    help="in-process engine only: after every 5th step, an empty one (no rows: no plan, its "
                         "after_forward), as vLLM's asynchronous scheduling (a GPU engine's default; the CPU "
                         "platform turns it off) runs once a batch reaches its last tokens")
    args = ap.parse_args()

    import numpy as np

    from engine_ext import Engine, GenerationParams
    from engine_ext.dynamic.policy import PolicyState
    from engine_ext.dynamic.specs import DynamicRequest, Policy, Probe
    from engine_ext.sites import Site

    kw = {"model": args.model} if args.model else {}
    extra = {"enforce_eager": False} if args.device == "cuda" else {}  # the model's own context length
    eng = Engine(device=args.device, **kw, **extra).start()
    if args.empty_steps:
        _empty_steps(eng)
    L, H = eng.info.num_layers, eng.info.hidden_size
    rng = np.random.default_rng(0)
    d = rng.standard_normal(H).astype(np.float32)
    eng.register_probe(Probe.make("gpu-probe", f"L{L // 2}.post_block", direction=d / np.linalg.norm(d)))
    v = rng.standard_normal(H).astype(np.float32)
    params = GenerationParams(max_tokens=args.tokens, ignore_eos=True)
    tasks = []
    try:
        from engine_ext.bundled import bundled_tasks
        tasks = [f["prompt"] for f in bundled_tasks()["facts"][:16]]
    except Exception:
        pass
    prompts = tasks or [f"Sample prompt number {i} is about" for i in range(16)]
    # thresholds from an unsteered run's scores (median), so policies engage and release
    never = Policy.make(probe="gpu-probe", sites=[f"L{max(L // 2 - 1, 0)}.post_attn"], vector=v, on=1e30)
    base = eng.generate(prompts, params, dynamic=DynamicRequest.make([never]))
    scores = [e["score"] for g in base for e in g.intervention.dynamic["trace"][0]]
    on = float(np.median(scores))
    spread = float(np.std(scores)) or 1.0
    thr = Policy.make(probe="gpu-probe", sites=[f"L{max(L // 2 - 1, 0)}.post_attn"], vector=v * (spread / np.linalg.norm(v)),
                      on=on, off=on - 0.5 * spread, min_hold=2, scale=1.0)
    prop = Policy.make(probe="gpu-probe", mode="proportional", sites=[f"L{max(L // 2 - 1, 0)}.post_attn"],
                       vector=v / np.linalg.norm(v), target=on + spread, gain=0.5, min_scale=-4 * spread, max_scale=4 * spread)
    failures = 0

    def check(name, ok, **info):
        nonlocal failures
        failures += 0 if ok else 1
        print(json.dumps({"check": name, "ok": bool(ok), **info}), flush=True)

    runs = [eng.generate(prompts, params, dynamic=DynamicRequest.make([thr, prop])) for _ in range(2)]
    for i, g in enumerate(runs[0]):
        iv = g.intervention
        check(f"status[{i}]", iv.status == "ok", errors=iv.errors)
        n = len(g.prompt_token_ids)
        engaged_total = 0
        for k, pol in enumerate((thr, prop)):
            tr = iv.dynamic["trace"][k]
            check(f"positions[{i}][{k}]", [e["position"] for e in tr] == list(range(n - 1, n - 1 + len(g.token_ids))))
            st = PolicyState.start(pol)
            want = [0.0]
            for e in tr[:-1]:
                want.append(st.decide(e["score"]))
            check(f"rule[{i}][{k}]", [e["scale"] for e in tr] == want,
                  engaged=sum(e["engaged"] for e in tr), tokens=len(tr))
        engaged_total = sum(any(iv.dynamic["trace"][k][t]["engaged"] for k in range(2)) for t in range(len(g.token_ids)))
        check(f"actions[{i}]", iv.dynamic["actions"] == engaged_total, actions=iv.dynamic["actions"], engaged=engaged_total)
    same = all(a.intervention.dynamic["trace"] == b.intervention.dynamic["trace"] and a.token_ids == b.token_ids
               for a, b in zip(*runs))
    check("repeatable", same)
    # one policy per request: steady decode steps repeat the last step's plan (`Replay`), and with
    # decisions on the device (`device_decisions`) no step waits for the scores;
    # each mode must give the tokens, traces and action counts of planning request by request
    def replayed():
        return sum(w.get("replayed_steps") or 0 for w in eng.dynamic_status()["workers"])

    def graph_replays():
        return sum(w.get("graph_replays") or 0 for w in eng.dynamic_status()["workers"])

    # the reference, "host", runs everything eagerly; chains of repeated steps replay their
    # repeating work as CUDA graphs (`engine_ext.dynamic.step_graphs`, the default: the scores,
    # and with decisions on the device the decision and rewrite), so equal results also show the
    # graphs bit-exact
    for name, pol in (("threshold", thr), ("proportional", prop)):
        modes = {}
        for mode, (replay, device, graphs) in {"host": (False, False, False), "host_graphs": (False, False, True),
                                               "replay": (True, False, True), "device": (True, True, True),
                                               "device_no_graphs": (True, True, False)}.items():
            eng._rpc("cb_set_dyn_replay", replay)
            eng._rpc("cb_set_dyn_device", device)
            eng._rpc("cb_set_dyn_graphs", graphs)
            before, g_before = replayed(), graph_replays()
            gens = eng.generate(prompts, params, dynamic=DynamicRequest.make([pol]))
            modes[mode] = (gens, replayed() - before)
            graphs_ran = graph_replays() - g_before
            # graphs need a chain (its steps repeat, `AFTER` in a row): always with decisions on
            # the device, or for proportional control; a threshold chain decided on the host may
            # break too often (a flip ends it)
            want = graphs and replay and args.device == "cuda"
            check(f"single[{name}][{mode}].graphs",
                  graphs_ran == 0 if not want else (graphs_ran > 0 or (name == "threshold" and not device)),
                  graph_replays=graphs_ran)
        eng._rpc("cb_set_dyn_replay", True)
        eng._rpc("cb_set_dyn_device", "auto")  # the defaults
        eng._rpc("cb_set_dyn_graphs", True)
        # the faster modes ran (threshold's plain repeat needs two steps in a row without a flip)
        check(f"single[{name}].repeated", modes["device"][1] > 0
              and (name == "threshold" or modes["replay"][1] > 0))
        ref = modes["host"][0]
        for mode, (gens, steps) in modes.items():
            ok = all(g.intervention.status == "ok" for g in gens)
            st_ok, first_bad = [], None
            for i, g in enumerate(gens):
                tr = g.intervention.dynamic["trace"][0]
                st = PolicyState.start(pol)
                want = [0.0] + [st.decide(e["score"]) for e in tr[:-1]]
                got = [e["scale"] for e in tr]
                acts = g.intervention.dynamic["actions"]
                st_ok.append(got == want and acts == sum(e["engaged"] for e in tr))
                if not st_ok[-1] and first_bad is None:
                    t = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
                    first_bad = {"request": i, "token": t, "tokens": len(tr), "actions": acts,
                                 "engaged": sum(e["engaged"] for e in tr),
                                 "around": None if t is None else [tr[k] for k in range(max(t - 2, 0), min(t + 2, len(tr)))],
                                 "want": None if t is None else want[max(t - 2, 0):t + 2]}
            check(f"single[{name}][{mode}].rule", ok and all(st_ok), steps_repeated=steps,
                  **({"first_mismatch": first_bad, "requests_bad": st_ok.count(False)} if first_bad else {}))
            if mode != "host":
                same = [a.token_ids == b.token_ids and a.intervention.dynamic["trace"] == b.intervention.dynamic["trace"]
                        and a.intervention.dynamic["actions"] == b.intervention.dynamic["actions"] for a, b in zip(gens, ref)]
                diff = {}
                if not all(same):
                    i = same.index(False)
                    ta, tb = gens[i].intervention.dynamic["trace"][0], ref[i].intervention.dynamic["trace"][0]
                    t = next((t for t, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
                    diff = {"first_difference": {"request": i, "token": t, "tokens_equal": gens[i].token_ids == ref[i].token_ids,
                                                 "this": None if t is None else ta[t], "host": None if t is None else tb[t]},
                            "requests_different": same.count(False)}
                check(f"single[{name}][{mode}].equals_host", all(same), steps_repeated=steps, **diff)
    check("single.determinism", eng.dynamic_status()["determinism"].get("consistent") is True)
    # a steady decode's unchanged row and capture tables are not uploaded again
    # (`StepPlanner._upload`): static steering, and both policies with their default decisions,
    # must give the same tokens, traces and actions as with every table uploaded every step
    from engine_ext.specs import Interventions, Steer

    def skipped():
        return sum(w.get("uploads_skipped") or 0 for w in eng._rpc("cb_status"))

    static = Interventions(steer=(Steer.make([f"L{L // 2}.post_block"], v * (spread / np.linalg.norm(v))),))
    for name, kw in (("static", {"interventions": static}), ("threshold", {"dynamic": DynamicRequest.make([thr])}),
                     ("proportional", {"dynamic": DynamicRequest.make([prop])})):
        out = {}
        for on in (False, True):
            eng._rpc("cb_set_upload_skip", on)
            before = skipped()
            gens = eng.generate(prompts, params, **kw)
            out[on] = ([g.token_ids for g in gens],
                       [(g.intervention.dynamic or {}).get("trace") for g in gens],
                       [(g.intervention.dynamic or {}).get("actions") for g in gens],
                       [g.intervention.status for g in gens], skipped() - before)
        eng._rpc("cb_set_upload_skip", True)
        check(f"upload_skip[{name}].same", out[True][:4] == out[False][:4] and set(out[True][3]) == {"ok"},
              skipped_on=out[True][4], skipped_off=out[False][4])
        check(f"upload_skip[{name}].ran", out[False][4] == 0 and (out[True][4] > 0) == (args.device == "cuda"),
              skipped_on=out[True][4])
    # the reference fork's declarative gates (issue 16): a host-probe gate (rest_of_request) and a
    # soft this_token gate on one batch; replaying GateState over each trace's scores must give the
    # trace's scales exactly, and the same batch run twice must give identical traces
    from engine_ext.dynamic.gates import Gate, GateSet, GateState, SiteVectors, gate_value
    from engine_ext.specs import Capture, Interventions
    # a gate's probe as the completions route builds it (app/fork/gates.py: a direction, content-named)
    du = (d / np.linalg.norm(d)).astype(np.float32)
    gsite = Site(L // 2, "post_block")
    gprobe = Probe("~gpu-gate-probe", gsite, "direction", du[None, :], np.zeros(1, np.float32))
    steer = SiteVectors((Site.parse(f"L{max(L // 2 - 1, 0)}.post_attn"),), (v * (spread / np.linalg.norm(v)),))
    # the soft gate's vector also at the probe's site (where the row gate scales it), along the probe
    at_probe = (spread * (du + v / np.linalg.norm(v))).astype(np.float32)
    soft_steer = SiteVectors(steer.sites + (gsite,), steer.vectors + (at_probe,))
    soft_gate = Gate("this_token", "probe", gprobe, threshold=on, sharpness=4.0 / spread, steer=soft_steer, strength=0.5)
    gs = GateSet((Gate("rest_of_request", "probe", gprobe, threshold=on, sharpness=1.0, steer=steer), soft_gate))
    cap = Interventions(capture=Capture((gsite,), "all"))
    gate_runs = [eng.generate(prompts, params, cap, dynamic=DynamicRequest(gates=gs)) for _ in range(2)]
    armed = discriminating = 0
    for i, g in enumerate(gate_runs[0]):
        iv = g.intervention
        check(f"gates.status[{i}]", iv.status == "ok", errors=iv.errors)
        tr = iv.dynamic["gates"]["trace"]
        n = len(g.prompt_token_ids)
        st = GateState(gs, n)
        want = [tuple(0.0 for _ in gs.components())]
        for e in tr[:-1]:
            want.append(st.decide(e["position"], e["scores"]))
        got = [tuple(e["scales"]) for e in tr]
        check(f"gates.rule[{i}]", got == [tuple(w) for w in want], armed_at=iv.dynamic["gates"]["armed_at"])
        armed += iv.dynamic["gates"]["armed_at"] is not None
        # the row gate, position by position: g from the in-graph score, the score from the pre-edit value
        gated = [(e["position"], e["scores"][1], e["soft"][1], e["scales"]) for e in tr if e["soft"][1] is not None]
        sig_err = pre_err = 0.0
        post_seen = []  # positions where g * t moves the projection by over 2 tolerances: |post - score| / tol
        for pos, score, g, scales in gated:
            sig_err = max(sig_err, abs(g - gate_value(score, soft_gate.threshold, soft_gate.sharp)))
            term = gs.row_term(tuple(scales), gsite)
            vpost = np.asarray(iv.captures[(gsite.layer, gsite.hook, pos)], np.float64)
            pre = float((vpost - g * term) @ du)
            post = float(vpost @ du)
            tol = 1e-2 * (1.0 + abs(score))
            pre_err = max(pre_err, abs(pre - score) / tol)
            if g * abs(float(term @ du)) > 2 * tol:
                post_seen.append(abs(post - score) / tol)
        soft_here = [g for _, _, g, _ in gated]
        discriminating += len(post_seen)
        check(f"gates.row_gate[{i}]", len(gated) == max(0, len(tr) - 2) and sig_err < 1e-5 and pre_err < 1.0
              and all(e > 1.0 for e in post_seen), gated=len(gated), sigmoid_err=sig_err, pre_edit_err=pre_err,
              post_edit_err=min(post_seen, default=None), soft=[min(soft_here, default=None), max(soft_here, default=None)])
    check("gates.some_armed", armed > 0, armed=armed, of=len(prompts))
    check("gates.row_gate_discriminates", discriminating > 0, positions=discriminating)
    check("gates.repeatable", all(a.intervention.dynamic["gates"]["trace"] == b.intervention.dynamic["gates"]["trace"]
                                  and a.token_ids == b.token_ids for a, b in zip(*gate_runs)))
    det = eng.dynamic_status()["determinism"]
    check("determinism", det["consistent"] is True, determinism=det)
    eng.close()
    print(json.dumps({"summary": "dynamic_gpu_check", "failures": failures}), flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
