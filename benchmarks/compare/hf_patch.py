#!/usr/bin/env python3
"""P1b: TransformerLens-style activation patching with Hugging Face forward hooks.

    python3 hf_patch.py --model MODEL_DIR

Model: LlamaForCausalLM(config) built directly on the GPU in bf16 (random init, seed 0),
eval(), torch.inference_mode(), use_cache=False, default attention implementation.
Prompts: a "clean" 16-token prompt (random ids) and a "corrupt" copy with positions 3-5
replaced. Metric: log_softmax of the last position's logits, gathered at two token ids.

1. clean run: forward hooks on every model.model.layers[l] cache that layer's output
   (the residual stream after layer l), shape [16 layers, 16 positions, 2048].
2. loop: for each of 16 layers x 16 positions = 256 cells, register a forward hook on
   layers[l] that overwrites position p of its output with the clean value, run one
   forward of the corrupt prompt (batch 1), store the two logprobs in a GPU tensor
   (no per-cell host sync, as TransformerLens's patching loop), remove the hook.
3. batched: 64 cells per forward: batch of 64 copies of the corrupt prompt, one hook per
   layer present in the chunk, each overwriting out[rows, pos] for its own rows.
   Also 256 cells per forward (one forward), as an extra point.
4. reference: the same 256 forwards with no hook at all.
1 warm-up pass + --reps timed passes of all 256 cells each; medians; every result is one
JSON line starting with {"bench": "HF", ...}. Cells/s extrapolated to 768 cells.
"""
import argparse
import json
import statistics
import sys
import time

A_ID, B_ID = 1000, 2000


def emit(**kw):
    print(json.dumps({"bench": "HF", **kw}, default=str), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunks", default="64,256")
    ap.add_argument("--device", default="cuda", help="cpu only for a local test of the script")
    ap.add_argument("--len", type=int, default=16, help="prompt length (cells = layers x len)")
    ap.add_argument("--variants", default="loop,batched,nohook")
    args = ap.parse_args()

    t0 = time.time()
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    emit(step="import", seconds=round(time.time() - t0, 2), torch=torch.__version__,
         transformers=transformers.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
         python=sys.version.split()[0])
    cfg = LlamaConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    dev = torch.device(args.device)
    if dev.type != "cuda":
        torch.cuda.synchronize = lambda *a, **k: None  # CPU test: nothing to wait for
        torch.cuda.max_memory_allocated = lambda *a, **k: 0
    with dev:
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    torch.cuda.synchronize()
    layers = model.model.layers
    L, P = len(layers), args.len
    emit(step="build", seconds=round(time.time() - t0, 2),
         params=sum(p.numel() for p in model.parameters()),
         dtype=str(next(model.parameters()).dtype),
         attn_impl=getattr(model.config, "_attn_implementation", None),
         rope=getattr(model.config, "rope_parameters", None), n_layers=L,
         layer_type=type(layers[0]).__name__)

    global A_ID, B_ID
    lo, hi = (1000, 128000) if cfg.vocab_size > 128000 else (4, cfg.vocab_size - 1)  # small CPU smoke model
    if cfg.vocab_size <= 128000:
        A_ID, B_ID = 10, 20
    g = torch.Generator().manual_seed(1)
    clean_ids = torch.randint(lo, hi, (P,), generator=g)
    corrupt_ids = clean_ids.clone()
    corrupt_ids[3:6] = torch.randint(lo, hi, (3,), generator=g)
    clean_ids, corrupt_ids = clean_ids.to(dev), corrupt_ids.to(dev)
    cells = [(l, p) for l in range(L) for p in range(P)]  # 256
    idx_ab = torch.tensor([A_ID, B_ID], device=dev)

    def metric(logits):  # [B, T, V] -> [B, 2]
        return torch.log_softmax(logits[:, -1].float(), dim=-1)[:, idx_ab]

    def out_tensor(out):
        return out[0] if isinstance(out, tuple) else out

    with torch.inference_mode():
        # 1. clean run with cache
        kinds = {}

        def clean_run():
            cache = {}

            def mk(l):
                def h(mod, a, out):
                    kinds[l] = type(out).__name__
                    cache[l] = out_tensor(out)[0].detach().clone()  # [P, H]
                return h

            hs = [layers[l].register_forward_hook(mk(l)) for l in range(L)]
            logits = model(input_ids=clean_ids[None], use_cache=False).logits
            for h in hs:
                h.remove()
            return torch.stack([cache[l] for l in range(L)]), metric(logits)[0]

        clean_run()  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        clean_stack, clean_lp = clean_run()
        torch.cuda.synchronize()
        t_clean = time.perf_counter() - t
        corrupt_lp = metric(model(input_ids=corrupt_ids[None], use_cache=False).logits)[0]
        emit(step="clean_cache", seconds=round(t_clean, 5), cache_shape=list(clean_stack.shape),
             layer_output=sorted(set(kinds.values())), clean_lp=clean_lp.tolist(), corrupt_lp=corrupt_lp.tolist())

        # 2. loop, batch 1, one hook per cell
        def loop(cs):
            res = torch.empty(len(cs), 2, device=dev)
            inp = corrupt_ids[None]
            for i, (l, p) in enumerate(cs):
                vec = clean_stack[l, p]

                def hook(mod, a, out, p=p, vec=vec):
                    out_tensor(out)[:, p] = vec

                h = layers[l].register_forward_hook(hook)
                logits = model(input_ids=inp, use_cache=False).logits
                h.remove()
                res[i] = metric(logits)[0]
            return res

        # 3. batched: n cells per forward, hooks index by batch row
        def batched(cs, n):
            res = torch.empty(len(cs), 2, device=dev)
            for s in range(0, len(cs), n):
                chunk = cs[s:s + n]
                inp = corrupt_ids[None].expand(len(chunk), P)
                by_layer = {}
                for r, (l, p) in enumerate(chunk):
                    by_layer.setdefault(l, []).append((r, p))
                hs = []
                for l, rp in by_layer.items():
                    rows = torch.tensor([r for r, _ in rp], device=dev)
                    pos = torch.tensor([p for _, p in rp], device=dev)
                    vals = clean_stack[l][pos]

                    def hook(mod, a, out, rows=rows, pos=pos, vals=vals):
                        out_tensor(out)[rows, pos] = vals

                    hs.append(layers[l].register_forward_hook(hook))
                logits = model(input_ids=inp, use_cache=False).logits
                for h in hs:
                    h.remove()
                res[s:s + len(chunk)] = metric(logits)
            return res

        # 4. reference: same forwards, no hooks
        def nohook(cs):
            res = torch.empty(len(cs), 2, device=dev)
            inp = corrupt_ids[None]
            for i in range(len(cs)):
                res[i] = metric(model(input_ids=inp, use_cache=False).logits)[0]
            return res

        def timed(fn, *a):
            fn(*a)  # warm-up pass
            torch.cuda.synchronize()
            ts, res = [], None
            for _ in range(args.reps):
                t = time.perf_counter()
                res = fn(*a)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
            return ts, res

        results = {}
        want = args.variants.split(",")
        variants = ([("loop_b1", loop, ())] if "loop" in want else []) + \
                   ([(f"batched_{n}", batched, (int(n),)) for n in args.chunks.split(",") if n] if "batched" in want else []) + \
                   ([("nohook_b1", nohook, ())] if "nohook" in want else [])
        for name, fn, extra in variants:
            ts, res = timed(fn, cells, *extra)
            results[name] = res
            m = statistics.median(ts)
            emit(step="variant", variant=name, prompt_len=P, cells=len(cells), times_s=[round(x, 4) for x in ts],
                 median_s=round(m, 4), cells_per_s=round(len(cells) / m, 1),
                 ms_per_cell=round(m / len(cells) * 1000, 4),
                 extrapolated_768_s=round(768 * m / len(cells), 3),
                 total_with_clean_768_s=round(768 * m / len(cells) + t_clean, 3),
                 peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        if "loop_b1" not in results or "nohook_b1" not in results:
            return
        ref = results["loop_b1"]
        for name, res in results.items():
            if name.startswith("batched"):
                emit(step="check", variant=name, max_abs_diff_vs_loop=float((res - ref).abs().max()))
        emit(step="check", what="patching changes the metric",
             max_abs_loop_minus_nohook=float((ref - results["nohook_b1"]).abs().max()),
             last_layer_last_pos_equals_clean=float((ref[-1] - clean_lp).abs().max()))


if __name__ == "__main__":
    main()
