"""Qwen2 and Qwen3 decoder layers are patched too (tiny random models, real vLLM on CPU), and an
unsupported architecture is refused at start-up instead of being served without interventions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine_ext import Engine, GenerationParams, SpecError
from engine_ext.reference.hf import HFReference, RefEdit
from engine_ext.specs import Interventions, Patch, Steer

from .conftest import model_path

pytestmark = pytest.mark.engine  # starts engines of its own


def _tiny(tmp_path, arch: str):
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    src = model_path()
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))
    out = tmp_path / arch
    model.to(torch.float32).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_sites_match_the_reference(tmp_path, arch, engine):
    # `engine` (the shared bundled-model engine) stays alive meanwhile: two engines in one process
    # must keep separate intervention state
    path = _tiny(tmp_path, arch)
    prompt = "The capital of Tarn is"
    ref = HFReference(path)
    # its own engine-core process: vLLM's distributed state is process-global, and shutting down a
    # second in-process engine would tear down the shared one's
    with Engine(model=str(path), device="cpu", multiprocess=True) as eng:
        assert eng.info.architecture.lower().startswith(arch)
        ids = eng.tokenize(prompt)
        sites = [(0, "pre_attn"), (0, "mlp_in"), (1, "post_attn"), (1, "mlp_out"), (1, "post_block")]
        gen = eng.capture(prompt, [f"L{l}.{h}" for l, h in sites], "all_prompt")
        run = ref.run(ids, capture=sites)
        # every site x position arrives (the engine core runs in its own process here)
        assert set(gen.captures) == {(l, h, p) for l, h in sites for p in range(len(ids))}
        for (layer, hook, pos), v in gen.captures.items():
            assert np.allclose(v, run.captures[(layer, hook)][pos].numpy(), atol=2e-4, rtol=2e-4)
        v = np.random.default_rng(0).standard_normal(128).astype(np.float32) * 4
        steered = eng.generate(prompt, GenerationParams(max_tokens=3, ignore_eos=True, logprobs=0),
                               Interventions(steer=(Steer.make(["L0.post_attn"], v),)))
        r = ref.generate(ids, 3, edits=[RefEdit.steer((0, "post_attn"), v, positions=range(len(ids)), gen=True)], stop_at_eos=False)
        assert steered.token_ids == r.token_ids
        assert np.allclose(steered.logprobs, r.logprobs, atol=2e-3)
        eng.capture(prompt, ["L1.pre_attn", "L0.mlp_out"], "all_prompt", keep_as="q", return_values=False)
        plain = eng.generate(prompt, GenerationParams(max_tokens=3, logprobs=0))
        patched = eng.generate(prompt, GenerationParams(max_tokens=3, logprobs=0), Interventions(patch=tuple(
            Patch.make(site, "all_prompt", {"run": "q"}) for site in ("L1.pre_attn", "L0.mlp_out"))))
        assert patched.intervention.status == "ok", patched.intervention.errors
        assert patched.logprobs == plain.logprobs  # bit-exact


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(SpecError, match="not supported") as err:
        Engine(model=str(tmp_path), device="cpu").start()
    assert err.value.field == "model"
