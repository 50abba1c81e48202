"""Build a tiny random-weight model and its tokenizer, offline and deterministically.

Two architectures: ``--arch llama`` (a plain full-attention Llama) and ``--arch gemma3`` (a
Gemma-3 text model whose layers alternate sliding-window and full attention: vLLM runs it as a
hybrid-attention model with two KV-cache groups, see docs/e2e-vllm.md).

The model exercises a real vLLM's serving, prefix caching and KV events without downloading
weights: the text it generates is gibberish, which is fine for routing checks. The tokenizer is
trained by ``scripts/make_tokenizer.py`` from the committed corpus, so it is byte-identical to
``assets/tokenizers/kvgate-tiny`` and the gateway can load either folder: the engine's token ids
and the gateway's must agree exactly, or every block key drifts.

Runs in the vLLM virtualenv (it needs ``torch`` and ``transformers``):

    .venv-vllm/bin/python scripts/make_tiny_model.py [--out models/tiny-llama] [--seed 0]
    .venv-vllm/bin/python scripts/make_tiny_model.py --arch gemma3 --out models/tiny-gemma3

Prints the output folder and the sha256 of the weights; the same seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

# The shape REAL_ENGINES.md measured: 0.8 M parameters, a 3.3 MB safetensors file.
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
MAX_POSITIONS = 4096
VOCAB = 2048
# Gemma 3: one sliding-window layer, one full-attention layer; a window of 64 tokens is two
# 32-token blocks, so a prefix hit needs the last cdiv(64 - 1, 32) = 2 blocks of the
# sliding-window group (vLLM's SlidingWindowManager).
SLIDING_WINDOW = 64
HEAD_DIM = 32


def _special_id(vocab: dict[str, int], token: str) -> int:
    if token not in vocab:
        raise SystemExit(f"tokenizer lacks the special token {token!r}")
    return vocab[token]


def _config(transformers: Any, arch: str, n_vocab: int, eos: int) -> Any:
    common = {
        "vocab_size": n_vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **common,
            head_dim=HEAD_DIM,
            query_pre_attn_scalar=HEAD_DIM,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
    raise SystemExit(f"unknown --arch {arch!r}")


MODEL_CLASS = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def build(out: Path, seed: int = 0, vocab_size: int = VOCAB, arch: str = "llama") -> str:
    """Write tokenizer files and a seeded random model into ``out``; return the weights' sha256."""
    make_tokenizer = importlib.import_module("make_tokenizer")
    # Imported here so that the module imports (and type-checks) without torch in the main venv.
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")

    make_tokenizer.build(vocab_size, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    n_vocab = max(vocab.values()) + 1
    eos = _special_id(vocab, "<|endoftext|>")

    torch.manual_seed(seed)
    config = _config(transformers, arch, n_vocab, eos)
    model = getattr(transformers, MODEL_CLASS[arch])(config).to(torch.float32)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    # transformers writes generation_config.json too; vLLM reads eos from it. Nothing else in the
    # folder carries a timestamp, so the same seed gives the same bytes.
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    return digest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "models/tiny-llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=VOCAB, help="tokenizer vocabulary size")
    ap.add_argument("--arch", choices=sorted(MODEL_CLASS), default="llama")
    args = ap.parse_args()
    digest = build(args.out, args.seed, args.vocab, args.arch)
    print(f"wrote {args.out} (model.safetensors sha256 {digest})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
