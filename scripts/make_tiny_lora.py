"""Build a tiny LoRA adapter for the tiny Llama (``scripts/make_tiny_model.py``), offline and
deterministically, in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``
with ``lora_A`` / ``lora_B`` weights of rank 8 on every layer's ``q_proj`` and ``v_proj``.

vLLM loads it with ``--enable-lora --lora-modules NAME=DIR`` or ``POST /v1/load_lora_adapter``
(the LoRA routing check of ``make e2e-vllm``, e2e/lora_check.py). Random weights: the output is
gibberish, which is fine for routing checks. Runs where ``torch`` and ``safetensors`` are
installed (the vLLM virtualenv):

    .venv-vllm/bin/python scripts/make_tiny_lora.py [--base models/tiny-llama] [--out models/tiny-llama-lora]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
from pathlib import Path
from typing import Any

RANK = 8
TARGETS = ("q_proj", "v_proj")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parent.parent
    ap.add_argument("--base", type=Path, default=root / "models/tiny-llama")
    ap.add_argument("--out", type=Path, default=root / "models/tiny-llama-lora")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # imported here: they live in the vLLM virtualenv, not the one that type-checks this file
    torch: Any = importlib.import_module("torch")
    save_file = importlib.import_module("safetensors.torch").save_file

    cfg = json.loads((args.base / "config.json").read_text())
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    out_dims = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    gen = torch.Generator().manual_seed(args.seed)
    tensors: dict[str, Any] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dims[mod], RANK, generator=gen) * 0.02
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(args.base),
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (args.out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    digest = hashlib.sha256((args.out / "adapter_model.safetensors").read_bytes()).hexdigest()
    print(f"{args.out} adapter_model.safetensors sha256 {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
