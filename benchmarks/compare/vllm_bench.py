#!/usr/bin/env python3
"""vLLM 0.25.1 anchor benchmarks, one engine per process; every result is one JSON line
starting with {"bench": ...}.

On the GPU host, from the repo root, after `source .vbundle/gpu_env.sh`:

    python3 vllm_bench.py --model SCRATCH/anchor-model --tag A \
        --prefix-caching on --tasks p1,p2            # CUDA graphs (default compile)
    python3 vllm_bench.py ... --eager --tasks p2,p1
    HOTWIRE_VECTORS=... python3 ... --hotwire rnd:8:4.0 --tasks hw   # needs hotwire-vllm on sys.path

Tasks
  p1  P1-limit: 768 requests, the same 16-token prompt (random ids), max_tokens=1,
      temperature 0, logprob_token_ids=[A, B] (falls back to logprobs=2 if refused);
      one llm.generate() call per repetition; 1 warm-up + --p1-reps timed.
  p2  decode: batch 1 and 32, distinct random 16-token prompts, max_tokens=256,
      ignore_eos, temperature 0; output tok/s = batch*256 / wall of llm.generate();
      1 warm-up + --p2-reps timed per batch size.
  hw  hotwire-vllm: batch 32 (and 1), same decode workload, idle (no request steered)
      and all-steered, interleaved idle/steered per repetition, same engine.
Model: config.json only, load_format="dummy" (random weights), skip_tokenizer_init,
prompt_token_ids, attention_backend TRITON_ATTN (the slim bundle has no FA/flashinfer).
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

A_ID, B_ID = 1000, 2000  # the two token ids whose logprobs a patch sweep reads
LO, HI = 1000, 128000  # prompt token ids (set_vocab narrows them for a small CPU smoke model)


def set_vocab(vocab_size: int) -> None:
    global A_ID, B_ID, LO, HI
    if vocab_size <= 128000:
        A_ID, B_ID, LO, HI = 10, 20, 4, vocab_size - 1



def emit(tag, **kw):
    print(json.dumps({"bench": tag, **kw}, default=str), flush=True)


def med(xs):
    return statistics.median(xs) if xs else None


def engine_info(llm):
    info = {}
    try:
        vc = llm.llm_engine.vllm_config
        cc = vc.compilation_config
        info.update(
            block_size=vc.cache_config.block_size,
            enable_prefix_caching=vc.cache_config.enable_prefix_caching,
            max_num_seqs=vc.scheduler_config.max_num_seqs,
            max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
            max_model_len=vc.model_config.max_model_len,
            enforce_eager=vc.model_config.enforce_eager,
            compilation_mode=str(getattr(cc, "mode", None)),
            cudagraph_mode=str(getattr(cc, "cudagraph_mode", None)),
            cudagraph_capture_sizes=(list(cc.cudagraph_capture_sizes)
                                     if getattr(cc, "cudagraph_capture_sizes", None) else None),
            async_scheduling=getattr(vc.scheduler_config, "async_scheduling", None),
            attention_backend=str(getattr(getattr(vc, "attention_config", None), "backend", None)),
        )
    except Exception as e:  # noqa: BLE001 - report only
        info["error"] = repr(e)
    info["env"] = {k: os.environ.get(k) for k in (
        "VLLM_USE_V2_MODEL_RUNNER", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER",
        "VLLM_PLUGINS", "HOTWIRE_VECTORS")}
    return info


def task_p1(llm, SamplingParams, args):
    rng = random.Random(0)
    prompt = [rng.randrange(LO, HI) for _ in range(16)]
    reqs = [{"prompt_token_ids": list(prompt)} for _ in range(args.p1_n)]
    mode = "logprob_token_ids"
    err = None
    try:
        sp = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=[A_ID, B_ID],
                            detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        warm = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - fall back as the brief says
        err = repr(e)
        mode = "logprobs=2"
        sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        warm = time.perf_counter() - t0
    times = []
    for _ in range(args.p1_reps):
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    lp0 = outs[0].outputs[0].logprobs[0] if outs[0].outputs[0].logprobs else {}
    n_ok = sum(1 for o in outs if o.outputs[0].logprobs
               and {A_ID, B_ID} <= set(o.outputs[0].logprobs[0].keys()))
    m = med(times)
    emit(args.tag, task="p1", n_requests=args.p1_n, prompt_len=16, logprob_mode=mode,
         logprob_error=err, warmup_s=round(warm, 4), times_s=[round(t, 4) for t in times],
         median_s=round(m, 4), req_per_s=round(args.p1_n / m, 1),
         n_outputs=len(outs), n_with_both_ids=n_ok,
         sample_logprobs={int(k): round(v.logprob, 4) for k, v in lp0.items()},
         num_cached_tokens_req0=getattr(outs[0], "num_cached_tokens", None),
         num_cached_tokens_last=getattr(outs[-1], "num_cached_tokens", None))


def decode_reqs(batch, seed):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(LO, HI) for _ in range(16)]}
            for _ in range(batch)]


def run_decode(llm, sp, reqs):
    t0 = time.perf_counter()
    outs = llm.generate(reqs, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    return dt, ntok, list(outs[0].outputs[0].token_ids)


def task_p2(llm, SamplingParams, args):
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                        detokenize=False)
    for batch in args.batches:
        reqs = decode_reqs(batch, 100 + batch)
        warm, _, _ = run_decode(llm, sp, reqs)
        times, ntoks = [], []
        for _ in range(args.p2_reps):
            dt, ntok, _ = run_decode(llm, sp, reqs)
            times.append(dt)
            ntoks.append(ntok)
        m = med(times)
        emit(args.tag, task="p2", batch=batch, prompt_len=16, max_tokens=args.max_tokens,
             out_tokens=ntoks[0], warmup_s=round(warm, 4), times_s=[round(t, 4) for t in times],
             median_s=round(m, 4), out_tok_per_s=round(ntoks[0] / m, 1),
             ms_per_step=round(m / args.max_tokens * 1000, 3))


def _hw_probe(self):
    """Runs inside the worker via collective_rpc: did hotwire arm the model?"""
    out = {}
    try:
        import hotwire._state as hs

        st = hs.get()
        model = self.model_runner.model
        out["state"] = st is not None
        out["slots"] = dict(st.bank._by_id) if st is not None else None
        out["armed_layers"] = sum(1 for m in model.modules()
                                  if getattr(m, "_hotwire_idx", -1) >= 0)
        out["runner"] = type(self.model_runner).__module__ + "." + type(self.model_runner).__name__
    except Exception as e:  # noqa: BLE001
        out["error"] = repr(e)
    return out


def task_hw(llm, SamplingParams, args):
    vid, layer, scale = args.hotwire.split(":")
    spec = json.dumps({"id": vid, "layer": int(layer), "scale": float(scale)})
    sp_idle = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                             detokenize=False)
    sp_steer = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                              detokenize=False, extra_args={"hotwire": spec})
    for batch in args.hw_batches:
        reqs = decode_reqs(batch, 100 + batch)  # same prompts as task p2
        w_idle, _, ids_idle = run_decode(llm, sp_idle, reqs)
        w_steer, _, ids_steer = run_decode(llm, sp_steer, reqs)
        ti, ts, ntok = [], [], 0
        for _ in range(args.p2_reps):
            dt, ntok, _ = run_decode(llm, sp_idle, reqs)
            ti.append(dt)
            dt, _, _ = run_decode(llm, sp_steer, reqs)
            ts.append(dt)
        mi, ms = med(ti), med(ts)
        emit(args.tag, task="hw", batch=batch, spec=spec, max_tokens=args.max_tokens,
             idle_times_s=[round(t, 4) for t in ti], steered_times_s=[round(t, 4) for t in ts],
             idle_tok_per_s=round(ntok / mi, 1), steered_tok_per_s=round(ntok / ms, 1),
             steered_over_idle_time=round(ms / mi, 4),
             warmup_idle_s=round(w_idle, 3), warmup_steered_s=round(w_steer, 3),
             greedy_ids_changed_by_steering=(ids_idle != ids_steer),
             ids_idle_head=ids_idle[:8], ids_steered_head=ids_steer[:8])
    try:
        emit(args.tag, task="hw_probe", workers=llm.collective_rpc(_hw_probe))
    except Exception as e:  # noqa: BLE001
        emit(args.tag, task="hw_probe", error=repr(e))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True")
    ap.add_argument("--prefix-caching", choices=["on", "off"], default="on")
    ap.add_argument("--tasks", default="p1,p2")
    ap.add_argument("--gpu-mem", type=float, default=0.8)
    ap.add_argument("--p1-n", type=int, default=768)
    ap.add_argument("--p1-reps", type=int, default=5)
    ap.add_argument("--p2-reps", type=int, default=3)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--hw-batches", default="32,1")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--hotwire", default=None, help="vector_id:layer:scale")
    ap.add_argument("--attn", default="TRITON_ATTN", help="attention backend (CPU test: CPU_ATTN)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.hw_batches = [int(x) for x in args.hw_batches.split(",") if x]
    tasks = [t for t in args.tasks.split(",") if t]
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.hotwire:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # for the collective_rpc probe

    t_all = time.time()
    t0 = time.time()
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    emit(args.tag, step="import", seconds=round(time.time() - t0, 2), vllm=vllm.__version__,
         torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, python=sys.version.split()[0])
    kw = dict(model=args.model, load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True,
              attention_backend=args.attn, enforce_eager=args.eager,
              enable_prefix_caching=(args.prefix_caching == "on"), seed=0)
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = args.gpu_mem
    t0 = time.time()
    llm = LLM(**kw)
    set_vocab(llm.llm_engine.model_config.get_vocab_size())
    emit(args.tag, step="llm_init", seconds=round(time.time() - t0, 2), kwargs=kw,
         engine=engine_info(llm))
    fns = {"p1": task_p1, "p2": task_p2, "hw": task_hw}
    for t in tasks:
        try:
            fns[t](llm, SamplingParams, args)
        except Exception as e:  # noqa: BLE001 - report and go on
            import traceback

            emit(args.tag, task=t, error=repr(e), tb=traceback.format_exc()[-2000:])
    emit(args.tag, step="done", total_seconds=round(time.time() - t_all, 2))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        print("shutdown:", repr(e), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
