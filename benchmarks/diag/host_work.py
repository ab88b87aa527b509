"""Host time of the per-request Python around the forward (issue #13: P3 capture, P1 patched
cells), by function, from a cProfile of an IN-PROCESS engine (worker and client in one process:
`multiprocess=False`; on a GPU also `VLLM_ENABLE_V1_MULTIPROCESSING=0` in the environment).

    python3 benchmarks/diag/host_work.py [--model DIR] [--device cpu|cuda] [--n 1000] [--reps 3]
        [--dump DIR]   (each profile saved for pstats: DIR/<workload>-<rep>.prof)

Workloads (one `Engine.generate` call each, max_tokens 1):
  p3_capture   N distinct 16-token prompts, capture of every layer's post_block at the last prompt
               token (the P3 workload of `benchmarks/compare/cb_bench.py`)
  p3_vanilla   the same prompts, no spec
  p1_patched   N one-token cells on one corrupted 16-token prompt, each patching one
               (layer, hook, position) from a stored clean run, scoring two ids (P1)
  p1_scored    the same N requests scoring the two ids only

Per workload and repetition, one JSON line: the wall time unprofiled, then the cumulative
(inclusive) time of each named function under cProfile, scaled to ms per 1000 requests:
`capture_values` (worker: one request's captured block to fp32 bytes), `file_captures` (worker:
the step's captured rows to their requests), `register` (worker: parse the program and compose
the plan), `intervention_result` (client: decode a worker result), `sampling_clone` (vLLM's
per-request `SamplingParams.clone`), `prepare` (client: validate and build the vLLM request),
`add_request` (vLLM), `collect` (worker: results of finished requests), `build` (worker: one
request's plan, inside `register`), `plan_step` / `finish_step` (worker: a step's tables, per
step), `flush` (worker: a step's new slots to the device), `compile_program` (client: one spec
to its program, inside `prepare`). cProfile slows Python
down (roughly 2x): compare the same function before and after a change in the same kind of
process, not against the unprofiled wall time. With `--model` omitted the bundled model is used;
`--wide DIR` first builds (once) a random Llama with the benchmark model's hidden width (2048)
and 16 layers but tiny attention/MLP/vocab, so that the captured bytes per request equal the GPU
workload's while the forward stays cheap on a CPU.
"""
import argparse
import cProfile
import json
import pstats
import random
import time
from pathlib import Path

#: reported name -> (file suffix, function name) in cProfile's keys
FUNCTIONS = {
    "capture_values": ("engine_ext/worker/state.py", "capture_values"),
    "file_captures": ("engine_ext/worker/planner.py", "file_captures"),
    "register": ("engine_ext/worker/state.py", "register"),
    "collect": ("engine_ext/worker/state.py", "collect"),
    "intervention_result": ("engine_ext/engine/outputs.py", "_intervention_result"),
    "sampling_clone": ("vllm/sampling_params.py", "clone"),
    "prepare": ("engine_ext/engine/facade.py", "_prepare"),
    "add_request": ("vllm/v1/engine/llm_engine.py", "add_request"),
    "build": ("engine_ext/worker/planner.py", "build"),
    "plan_step": ("engine_ext/worker/planner.py", "plan_step"),
    "finish_step": ("engine_ext/worker/planner.py", "finish_step"),
    "flush": ("engine_ext/worker/slots.py", "flush"),
    "compile_program": ("engine_ext/program.py", "compile_program"),
}


def make_wide_model(out: Path) -> Path:
    """A random LlamaForCausalLM: hidden 2048 (the benchmark model's), 16 layers, 2 heads of 64,
    MLP 64, vocab 512 (bf16, seed 0), with a word-level tokenizer."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    V = 512
    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>").save_pretrained(out)
    cfg = LlamaConfig(vocab_size=V, hidden_size=2048, intermediate_size=64, num_hidden_layers=16,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def function_times(prof: cProfile.Profile, n: int) -> dict[str, float]:
    """Cumulative time of each of FUNCTIONS, ms per 1000 requests."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    out = {}
    for label, (suffix, name) in FUNCTIONS.items():
        ct = sum(v[3] for (f, _, fn), v in stats.items() if fn == name and f.endswith(suffix))
        out[label] = round(ct * 1000.0 * 1000.0 / n, 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--wide", default=None, help="build (once) and use the wide random model in this folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workloads", default="p3_capture,p3_vanilla,p1_patched,p1_scored")
    ap.add_argument("--tag", default="")
    ap.add_argument("--dump", default=None, help="also save each profile (pstats) as DIR/<workload>-<rep>.prof")
    args = ap.parse_args()
    model = str(make_wide_model(Path(args.wide))) if args.wide else args.model
    from engine_ext import Engine, GenerationParams
    from engine_ext.specs import Capture, Interventions, Patch, RunSource

    kw = dict(enforce_eager=False, max_model_len=4096, gpu_memory_utilization=0.8, batch_invariant=False) if args.device == "cuda" else {}
    if model:
        kw["model"] = model
    eng = Engine(device=args.device, multiprocess=False, **kw).start()
    L = eng.info.num_layers
    hi = min(eng.info.vocab_size - 1, 128000)
    prng = random.Random(7)
    prompts = [[prng.randrange(4, hi) for _ in range(16)] for _ in range(args.n)]
    one = GenerationParams(max_tokens=1)
    cap = Interventions(capture=Capture.make([f"L{layer}.post_block" for layer in range(L)], "last_prompt"))
    clean = [prng.randrange(4, hi) for _ in range(16)]
    corrupt = list(clean)
    corrupt[3:6] = [prng.randrange(4, hi) for _ in range(3)]
    hooks = ("pre_attn", "post_attn", "post_block")
    cells = [(layer, h, p) for layer in range(L) for h in hooks for p in range(16)]
    cells = [cells[i % len(cells)] for i in range(args.n)]
    eng.capture(clean, [f"L{layer}.{h}" for layer in range(L) for h in hooks], "all_prompt", keep_as="clean",
                return_values=False)
    score = (1, 2)
    work = {
        "p3_capture": (prompts, cap),
        "p3_vanilla": (prompts, None),
        "p1_patched": ([corrupt] * args.n, [Interventions(patch=(Patch.make(f"L{layer}.{h}", [p], RunSource("clean", (p,))),),
                                                          score_token_ids=score) for layer, h, p in cells]),
        "p1_scored": ([corrupt] * args.n, [Interventions(score_token_ids=score)] * args.n),
    }
    names = args.workloads.split(",")
    for name in names:  # warm-up
        ps, spec = work[name]
        eng.generate(ps[:64], one, spec[:64] if isinstance(spec, list) else spec)
    for rep in range(args.reps):
        for name in names:
            ps, spec = work[name]
            t = time.perf_counter()
            gens = eng.generate(ps, one, spec)
            wall = time.perf_counter() - t
            if name == "p3_capture":
                assert all(len(g.intervention.captures) == L for g in gens), "missing captures"
            if name == "p1_patched":
                assert all(not g.intervention.voided for g in gens), "voided cells"
            prof = cProfile.Profile()
            prof.enable()
            t = time.perf_counter()
            eng.generate(ps, one, spec)
            prof_wall = time.perf_counter() - t
            prof.disable()
            if args.dump:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                prof.dump_stats(str(Path(args.dump) / f"{name}-{rep}.prof"))
            print(json.dumps({"bench": "host_work", "tag": args.tag, "workload": name, "rep": rep, "n": args.n,
                              "wall_s": round(wall, 4), "profiled_wall_s": round(prof_wall, 4),
                              "ms_per_1000": function_times(prof, args.n)}), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
