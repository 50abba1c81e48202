"""Train kvgate's small test tokenizer offline and deterministically from the committed corpus.

Writes ``tokenizer.json`` and ``tokenizer_config.json`` (with a ChatML-style Jinja chat template
that also renders a tool schema) into the output folder. Both the simulated engine and the
gateway load these files, and a real vLLM loads them as a ``PreTrainedTokenizerFast``, so all
three produce the same token ids.

    python scripts/make_tokenizer.py [--vocab 2048] [--out assets/tokenizers/kvgate-tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script, also from .venv-vllm (which does not install kvgate)
    sys.path.insert(0, str(ROOT))

from kvgate_tools.bpe_tokenizer import train_byte_level_bpe  # noqa: E402

CORPUS = [ROOT / "assets/corpus/stdlib_docstrings.txt", ROOT / "assets/corpus/multilingual.txt"]

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{%- endif %}"
    "You may call these tools:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- else %}"
    "{%- for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def build(vocab: int, out: Path) -> None:
    train_byte_level_bpe(vocab, CORPUS, out)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=ROOT / "assets/tokenizers/kvgate-tiny")
    args = ap.parse_args()
    build(args.vocab, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
