"""The one recipe of kvgate's byte-level BPE tokenizers (the 2k test tokenizer, the 32k benchmark
one, the featurizer benchmark's): trained offline and deterministically, with ChatML's special
tokens. Only ``tokenizers`` is imported, so that ``scripts/make_tokenizer.py`` runs in the vLLM
virtualenv too (docs/architecture.md, "Layout").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_byte_level_bpe(vocab: int, files: Sequence[Path], out: Path) -> None:
    """Train a ``vocab``-token byte-level BPE on ``files`` (in that order) and write
    ``out/tokenizer.json``; the caller writes ``tokenizer_config.json``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in files], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
