"""The transformers reference (test oracle): sites, captures and interventions.

Runs on the bundled model when it is there, otherwise on a tiny random Llama (hidden 64,
2 layers, vocab 50) written to a temporary directory. CPU, float32, a few seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_ext.reference.hf import HOOKS, HFReference, RefEdit, edits_from_program

EPS = 1e-5


def _tiny_model_dir(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 50)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine_ext.bundled import BUNDLED_MODEL_PATH

    if (BUNDLED_MODEL_PATH / "config.json").is_file():
        return BUNDLED_MODEL_PATH
    path = tmp_path_factory.mktemp("tiny-llama")
    _tiny_model_dir(path)
    return path


@pytest.fixture(scope="module")
def ref(model_dir) -> HFReference:
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def ids(ref) -> list[int]:
    rng = np.random.default_rng(0)
    V = ref.model.config.vocab_size
    bos = ref.tokenizer.bos_token_id
    body = [int(t) for t in rng.integers(3, min(V, 50), size=11)]
    return ([bos] if bos is not None else []) + body


@pytest.fixture(scope="module")
def clean(ref, ids):
    return ref.run(ids, capture="all")


def _vec(ref, seed: int, norm: float = 1.0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(ref.hidden_size).astype(np.float32)
    return v * np.float32(norm / np.linalg.norm(v))


def _close(actual, expected, k: float = 8.0) -> None:
    """Equal up to a few float32 roundings at the magnitude of the values involved."""
    expected = np.asarray(expected, np.float32)
    np.testing.assert_allclose(actual, expected, atol=k * EPS * (1 + float(np.abs(expected).max())), rtol=0)


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_captures_equal_hf_hidden_states(ref, ids, clean):
    with torch.no_grad():
        out = ref.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states
    L = ref.num_layers
    assert len(hs) == L + 1
    assert torch.equal(clean.logits, out.logits[0].float())
    for i in range(L):
        assert torch.equal(clean.captures[(i, "pre_attn")], hs[i][0].float()), i
        if i < L - 1:
            assert torch.equal(clean.captures[(i, "post_block")], hs[i + 1][0].float()), i
        assert torch.equal(clean.captures[(i, "post_block")], clean.captures[(i + 1, "pre_attn")] if i < L - 1
                           else clean.captures[(i, "post_block")])
    # the last layer's post_block is the value before the final norm; HF's last entry is after it
    with torch.no_grad():
        normed = ref.model.model.norm(clean.captures[(L - 1, "post_block")].unsqueeze(0))[0]
    assert torch.equal(normed, hs[-1][0].float())
    assert not torch.equal(clean.captures[(L - 1, "post_block")], hs[-1][0].float())


def test_post_attn_is_pre_attn_plus_attention_output(ref, ids, clean):
    attn_out = {}
    handles = [layer.self_attn.register_forward_hook(
        lambda _m, _a, out, i=i: attn_out.__setitem__(i, out[0][0].detach().clone()))
        for i, layer in enumerate(ref.layers)]
    try:
        ref.logits(ids)
    finally:
        for h in handles:
            h.remove()
    for i in range(ref.num_layers):
        expected = clean.captures[(i, "pre_attn")] + attn_out[i].float()
        assert torch.equal(clean.captures[(i, "post_attn")], expected), i
        assert not torch.equal(clean.captures[(i, "post_attn")], clean.captures[(i, "pre_attn")])


def test_hooks_are_removed_also_on_error(ref, ids, clean, monkeypatch):
    before = _hooks(ref.model)
    ref.run(ids, [RefEdit.steer((0, "post_attn"), _vec(ref, 1), positions=[2])], capture="all")
    assert _hooks(ref.model) == before

    def boom(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(ref.model.model.norm, "forward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        ref.run(ids, [RefEdit.zero((1, "pre_attn"), [1])], capture="all")
    monkeypatch.undo()
    assert _hooks(ref.model) == before
    assert torch.equal(ref.run(ids).logits, clean.logits)


def test_replace_with_own_values_is_bit_identical(ref, ids, clean):
    n = len(ids)
    for site in ref.all_sites():
        r = ref.run(ids, [RefEdit.patch(site, range(n), clean.captures[site].numpy())], capture=[site])
        assert torch.equal(r.logits, clean.logits), site
        assert torch.equal(r.captures[site], clean.captures[site]), site
    # all sites at once, too
    edits = [RefEdit.patch(s, range(n), clean.captures[s].numpy()) for s in ref.all_sites()]
    assert torch.equal(ref.run(ids, edits).logits, clean.logits)


def test_replace_own_values_bit_identical_bf16(model_dir, ids):
    ref16 = HFReference(model_dir, dtype="bfloat16")
    c = ref16.run(ids, capture="all")
    n = len(ids)
    edits = [RefEdit.patch(s, range(n), c.captures[s].numpy()) for s in ref16.all_sites()]
    r = ref16.run(ids, edits, capture="all")
    assert torch.equal(r.logits, c.logits)
    for s in ref16.all_sites():
        assert torch.equal(r.captures[s], c.captures[s]), s


@pytest.mark.parametrize("hook", HOOKS)
def test_add_shifts_site_by_scale_v_and_is_causal(ref, ids, clean, hook):
    p, scale = 5, 3.0
    v = _vec(ref, 2, norm=4.0)
    for layer in range(ref.num_layers):
        site = (layer, hook)
        r = ref.run(ids, [RefEdit.steer(site, v, scale=scale, positions=[p])], capture=[site])
        diff = (r.captures[site] - clean.captures[site]).numpy()
        tol = EPS * (1 + np.abs(clean.captures[site][p].numpy()).max() + scale * np.abs(v).max())
        np.testing.assert_allclose(diff[p], scale * v, atol=tol, rtol=0)
        assert np.all(diff[:p] == 0) and np.all(diff[p + 1:] == 0), "only the steered position changes at the site"
        assert torch.equal(r.logits[:p], clean.logits[:p]), "earlier positions are unaffected (causality)"
        assert not torch.equal(r.logits[p], clean.logits[p])
        if hook == "pre_attn" or layer < ref.num_layers - 1:  # an attention still reads it
            assert not torch.equal(r.logits[p + 1:], clean.logits[p + 1:])
        else:  # past the last attention the edit stays at its own position
            assert torch.equal(r.logits[p + 1:], clean.logits[p + 1:])


def test_zero_ablation_and_lerp(ref, ids, clean):
    site, pos = (1 % ref.num_layers, "post_attn"), [2, 4]
    r = ref.run(ids, [RefEdit.zero(site, pos)], capture=[site])
    assert torch.all(r.captures[site][pos] == 0)
    assert torch.equal(r.captures[site][:2], clean.captures[site][:2])
    assert torch.equal(r.logits[:2], clean.logits[:2])
    s = clean.captures[site][pos].numpy()
    t = np.stack([_vec(ref, 3, 5.0), _vec(ref, 4, 5.0)])
    r = ref.run(ids, [RefEdit.patch(site, pos, t, alpha=0.25)], capture=[site])
    _close(r.captures[site][pos].numpy(), 0.75 * s + 0.25 * t)
    # zero-ablation with alpha < 1 scales the stream
    r = ref.run(ids, [RefEdit.zero(site, pos, alpha=0.5)], capture=[site])
    np.testing.assert_array_equal(r.captures[site][pos].numpy(), np.float32(0.5) * s)


def test_patch_then_add_whatever_the_order_given(ref, ids, clean):
    site, p = (0, "post_block"), 3
    s = clean.captures[site][p].numpy()
    t, v = _vec(ref, 5, 6.0), _vec(ref, 6, 2.0)
    alpha, scale = 0.5, 1.5
    add = RefEdit.steer(site, v, scale=scale, positions=[p])
    rep = RefEdit.patch(site, [p], t, alpha=alpha)
    a = ref.run(ids, [add, rep], capture=[site])
    b = ref.run(ids, [rep, add], capture=[site])
    assert torch.equal(a.captures[site], b.captures[site]) and torch.equal(a.logits, b.logits)
    # the engine's composition, bit for bit: a * s + (alpha * t + v * scale)
    c = np.float32(alpha) * t + v * np.float32(scale)
    expected = (torch.tensor(np.float32(1 - alpha)) * torch.from_numpy(s) + torch.from_numpy(c)).numpy()
    np.testing.assert_array_equal(a.captures[site][p].numpy(), expected)
    wrong = (1 - alpha) * (s + scale * v) + alpha * t  # add-then-patch
    assert np.abs(a.captures[site][p].numpy() - wrong).max() > 0.1
    # a full replacement with adds: the add still lands on top of the target
    r = ref.run(ids, [add, RefEdit.patch(site, [p], t)], capture=[site])
    np.testing.assert_array_equal(r.captures[site][p].numpy(), t + v * np.float32(scale))
    # several adds at one site sum in the order given
    w = _vec(ref, 7, 1.0)
    r = ref.run(ids, [add, RefEdit.steer(site, w, positions=[p])], capture=[site])
    _close(r.captures[site][p].numpy(), s + scale * v + w)


def test_last_replace_wins(ref, ids):
    site = (0, "pre_attn")
    t1, t2 = _vec(ref, 8), _vec(ref, 9)
    r = ref.run(ids, [RefEdit.patch(site, [1, 2], t1), RefEdit.patch(site, [2], t2)], capture=[site])
    np.testing.assert_array_equal(r.captures[site][1].numpy(), t1)
    np.testing.assert_array_equal(r.captures[site][2].numpy(), t2)


def test_noise_is_deterministic_by_seed(ref, ids, clean):
    from engine_ext.program import noise_vectors

    pos = [1, 2, 3]
    e1, e2, e3 = ref.noise_edit(pos, scale=3.0, seed=7), ref.noise_edit(pos, scale=3.0, seed=7), ref.noise_edit(pos, scale=3.0, seed=8)
    std = float(ref.model.get_input_embeddings().weight.detach().float().std())
    np.testing.assert_array_equal(e1.vectors, noise_vectors(3, ref.hidden_size, 3.0, std, 7))
    site = (0, "pre_attn")
    r1, r2, r3 = (ref.run(ids, [e], capture=[site]) for e in (e1, e2, e3))
    assert torch.equal(r1.logits, r2.logits) and torch.equal(r1.captures[site], r2.captures[site])
    assert not torch.equal(r1.logits, r3.logits)
    assert torch.equal(r1.logits[:1], clean.logits[:1])
    diff = (r1.captures[site] - clean.captures[site]).numpy()
    mag = 1 + float(np.abs(clean.captures[site][pos].numpy()).max()) + float(np.abs(e1.vectors).max())
    np.testing.assert_allclose(diff[pos], e1.vectors, atol=4 * EPS * mag, rtol=0)
    assert np.all(diff[4:] == 0) and np.all(diff[0] == 0)


def test_generate_without_edits_equals_greedy(ref, ids):
    g = ref.greedy(ids, 6)
    h = ref.generate(ids, 6)
    assert (h.prompt_token_ids, h.token_ids, h.logprobs, h.top2_gaps) == (g.prompt_token_ids, g.token_ids, g.logprobs, g.top2_gaps)
    assert h.step_logprobs.shape == (len(h.token_ids), ref.model.config.vocab_size)
    for k, t in enumerate(h.token_ids):
        assert float(h.step_logprobs[k, t]) == h.logprobs[k]


def test_generate_phases_and_generated_positions(ref, ids):
    n, T = len(ids), 5
    site = (ref.num_layers - 1, "post_attn")
    v = _vec(ref, 10, 8.0)
    base = ref.generate(ids, T, capture=[site], stop_at_eos=False)
    fed = n + T - 1
    assert base.captures[site].shape[0] == fed
    # decode-only steering over everything: prompt positions untouched, every fed-back token steered
    dec = ref.generate(ids, T, [RefEdit.steer(site, v, positions=range(n), gen=True, phase="decode")],
                       capture=[site], stop_at_eos=False)
    assert torch.equal(dec.step_logprobs[0], base.step_logprobs[0])  # step 0 sees only the prompt
    assert torch.equal(dec.captures[site][:n], base.captures[site][:n])
    # recompute the reference of the final forward: same tokens, steering at the generated positions
    final = dec.prompt_token_ids + dec.token_ids[:-1]
    r = ref.run(final, [RefEdit.steer(site, v, positions=range(n, fed))], capture=[site])
    assert torch.equal(r.captures[site], dec.captures[site])
    # prefill-only over all positions == the prompt positions listed explicitly
    pre = ref.generate(ids, T, [RefEdit.steer(site, v, positions=range(n), gen=True, phase="prefill")], stop_at_eos=False)
    lst = ref.generate(ids, T, [RefEdit.steer(site, v, positions=range(n))], stop_at_eos=False)
    assert pre.token_ids == lst.token_ids and torch.equal(pre.step_logprobs, lst.step_logprobs)
    assert not torch.equal(pre.step_logprobs[0], base.step_logprobs[0])


def test_score_is_the_last_prompt_logprob(ref, ids, clean):
    toks = [0, 3, 7, ref.model.config.vocab_size - 1]
    logp = torch.log_softmax(clean.logits[-1], dim=-1)
    assert ref.score(ids, toks) == {t: float(logp[t]) for t in toks}
    e = [RefEdit.steer((0, "post_block"), _vec(ref, 11, 8.0), positions=[len(ids) - 1])]
    lp = ref.run(ids, e).logprobs(-1)
    assert ref.score(ids, toks, e) == {t: float(lp[t]) for t in toks}


def test_edits_from_compiled_program(ref, ids):
    from engine_ext.program import ModelDims, PromptInfo, compile_program
    from engine_ext.specs import Capture, Interventions, Noise, Patch, Steer

    L, H = ref.num_layers, ref.hidden_size
    v, t = _vec(ref, 12, 3.0), _vec(ref, 13, 3.0)
    spec = Interventions(
        steer=(Steer.make(["L0.post_attn", f"L{L - 1}.post_block"], v, scale=2.0, positions="all", phase="decode"),),
        patch=(Patch.make("L0.post_attn", [-1], {"vectors": [t]}, alpha=0.5), Patch.make("L0.pre_attn", [2], "zeros")),
        noise=Noise.make([1, 2], scale=3.0, seed=5),
        capture=Capture.make(["L0.post_attn", "L0.pre_attn"], "all"))
    prompt = PromptInfo(list(ids), max_tokens=4)
    dims = ModelDims(L, H, ref.model.config.vocab_size, ref.embedding_std)
    prog = compile_program(spec, prompt, dims, key="k", named_vector_dims=lambda _n: None)
    edits, capture = edits_from_program(prog)
    assert capture == [(0, "post_attn"), (0, "pre_attn")]
    n = len(ids)
    by_hand = [RefEdit.patch((0, "post_attn"), [n - 1], t, alpha=0.5), RefEdit.zero((0, "pre_attn"), [2]),
               RefEdit.steer((0, "post_attn"), v, scale=2.0, positions=range(n), gen=True, phase="decode"),
               RefEdit.steer((L - 1, "post_block"), v, scale=2.0, positions=range(n), gen=True, phase="decode"),
               ref.noise_edit([1, 2], scale=3.0, seed=5)]
    a = ref.generate(ids, 4, edits, capture, stop_at_eos=False)
    b = ref.generate(ids, 4, by_hand, capture, stop_at_eos=False)
    assert a.token_ids == b.token_ids and torch.equal(a.step_logprobs, b.step_logprobs)
    for s in capture:
        assert torch.equal(a.captures[s], b.captures[s])
    # zero-ablated first, then the noise lands on top of the zero
    np.testing.assert_array_equal(a.captures[(0, "pre_attn")][2].numpy(), by_hand[-1].vectors[1])


def test_bad_edits_are_refused(ref, ids):
    H = ref.hidden_size
    with pytest.raises(ValueError):
        RefEdit(0, "mid_attn", [0], "add", np.zeros(H))
    with pytest.raises(ValueError):
        RefEdit.steer((0, "pre_attn"), np.zeros((2, H)), positions=[0, 1], gen=True)
    with pytest.raises(ValueError):
        RefEdit.patch((0, "pre_attn"), [0, 1, 2], np.zeros((2, H)))
    with pytest.raises(ValueError):
        ref.run(ids, [RefEdit.steer((ref.num_layers, "pre_attn"), np.zeros(H), positions=[0])])
    with pytest.raises(ValueError):
        ref.run(ids, [RefEdit.steer((0, "pre_attn"), np.zeros(H + 1), positions=[0])])
    with pytest.raises(ValueError):
        ref.run(ids, capture=["L0.nope"])
