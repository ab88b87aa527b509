"""Word-level tokenizer for the bundled model, built with the ``tokenizers`` library.

Contract:

* Pre-tokenization: Metaspace (spaces become ``"▁"``, a ``"▁"`` is prepended to the
  text) followed by punctuation splitting, so ``"North Kell's capital is Quell."`` ->
  ``▁North ▁Kell ' s ▁capital ▁is ▁Quell .``.  A word and the same word after a space
  are the same token: ``"Quell"`` and ``" Quell"`` both encode to ``▁Quell``.
* The vocabulary is every piece of :func:`training.corpus.vocabulary_texts`, sorted,
  after the special tokens ``<unk>=0, <s>=1, </s>=2, <pad>=3``; unknown words -> ``<unk>``.
* The post-processor prepends ``<s>`` (BOS) to every encoding; EOS is never added
  automatically (training appends it).  The Metaspace decoder turns ``▁`` back into
  spaces, so ``decode(encode(text), skip_special_tokens=True) == text`` for corpus text.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIALS = (UNK, BOS, EOS, PAD)
MODEL_MAX_LENGTH = 128


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        pre_tokenizers.Punctuation(),
    ])


def build_tokenizer(texts: list[str]) -> Tokenizer:
    """Build the word-level tokenizer whose vocabulary covers every piece of ``texts``."""
    pre = _pre_tokenizer()
    pieces = {p for t in texts for p, _ in pre.pre_tokenize_str(t)}
    pieces.add("▁")  # a lone space (e.g. from a double space) is not an unknown token
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(sorted(pieces)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])])
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` loadable by AutoTokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def answer_token_id(tok: Tokenizer, word: str) -> int:
    """Id of ``word`` as the next token after a prompt (``" " + word``); raises if not one known token."""
    ids = tok.encode(" " + word, add_special_tokens=False).ids
    if len(ids) != 1 or ids[0] == tok.token_to_id(UNK):
        raise ValueError(f"answer {word!r} is not a single known token: {ids}")
    return ids[0]
