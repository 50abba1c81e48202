"""Loading a model's tokenizer folder the way ``transformers`` (and so vLLM) loads it.

A folder holds ``tokenizer.json`` (the ``tokenizers`` serialization) and ``tokenizer_config.json``
(special tokens, flags, usually the chat template), optionally ``chat_template.jinja`` and
``additional_chat_templates/*.jinja``. ``PreTrainedTokenizerFast`` does not use ``tokenizer.json``
as it is; it adjusts the backend in ways that change token ids, and we repeat exactly those:

- every named special token (``bos_token``, ``eos_token``, ...) and every extra special token of
  the config that is not already an added token becomes a special added token, so it is split out
  of text before BPE even when the base vocabulary has it;
- added tokens listed in the config's ``added_tokens_decoder`` are added with their flags;
- the config's ``add_bos_token``/``add_eos_token`` are ignored when ``tokenizer.json`` exists
  (transformers 5 drops them; what ``add_special_tokens=True`` adds is the file's own
  post-processor, none when it has none);
- truncation and padding are off (transformers resets them per call; vLLM never pads);
- ``split_special_tokens`` in the config makes special tokens encode as plain text.

The named special tokens are also what chat templates see as ``bos_token``, ``eos_token``, ...

Only the generic ``PreTrainedTokenizerFast`` path is reproduced (checked against transformers
5.23). A model whose ``tokenizer_class`` rebuilds its backend in Python (some SentencePiece
conversions) may differ: route such a model with ``tokenizer: remote``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from gateway.documents import read_document, read_text
from router_policies.errors import UserInputError

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order
SPECIAL_TOKEN_ATTRS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_TOKEN_FLAGS = ("lstrip", "rstrip", "single_word", "normalized", "special")


class FeatureConfigError(UserInputError):
    """A model's tokenizer files or feature settings are unusable; the message names the field."""


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer: Tokenizer
    special_tokens: dict[str, str]  # bos_token/eos_token/... -> content, as templates see them
    chat_template: str | None  # the single (or "default") template
    named_templates: dict[str, str] = field(default_factory=dict)  # name -> template ("tool_use", ...)

    def template_for(self, has_tools: bool) -> str | None:
        """The template transformers' ``get_chat_template`` picks: with several named templates,
        ``tool_use`` when tools are given, else ``default``."""
        if self.named_templates:
            if has_tools and "tool_use" in self.named_templates:
                return self.named_templates["tool_use"]
            return self.named_templates.get("default", self.chat_template)
        return self.chat_template


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _added_token(value: Any, *, special: bool) -> AddedToken | None:
    """An ``AddedToken`` from a config value: a string or ``{"content", "lstrip", ...}``."""
    content = _token_content(value)
    if content is None:
        return None
    if isinstance(value, Mapping):
        flags = {k: bool(value[k]) for k in _TOKEN_FLAGS if k in value}
        flags.setdefault("special", special)
        return AddedToken(content, **flags)
    return AddedToken(content, special=special)


def _read_json(path: Path, where: str) -> dict[str, Any]:
    data = read_document(path, "JSON", lambda why: FeatureConfigError(f"{where}: {path}: {why}"))
    if not isinstance(data, dict):
        raise FeatureConfigError(f"{where}: {path} must hold a JSON object")
    return data


def _templates(folder: Path, cfg: Mapping[str, Any], where: str) -> tuple[str | None, dict[str, str]]:
    single: str | None = None
    named: dict[str, str] = {}
    raw = cfg.get("chat_template")
    if isinstance(raw, str):
        single = raw
    elif isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
                named[str(entry["name"])] = str(entry.get("template", ""))

    def failed(path: Path) -> Callable[[str], Exception]:
        return lambda why: FeatureConfigError(f"{where}: {path}: {why}")

    # transformers prefers the standalone files to the config's copy
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        single = read_text(jinja, failed(jinja))
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            named[f.stem] = read_text(f, failed(f))
    if named:
        if single is not None:
            named.setdefault("default", single)
        if "default" not in named:
            raise FeatureConfigError(
                f"{where}: several chat templates ({', '.join(sorted(named))}) and none named 'default'"
            )
        single = named["default"]
    return single, named


def load_tokenizer_files(
    folder: Path, *, where: str, chat_template_override: str | None = None
) -> TokenizerFiles:
    """Load ``folder`` as transformers would; ``where`` names the config field for errors."""
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise FeatureConfigError(f"{where}: {tok_path} does not exist")
    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # the tokenizers library raises plain Exception subclasses
        raise FeatureConfigError(f"{where}: cannot load {tok_path}: {exc}") from None
    cfg_path = folder / "tokenizer_config.json"
    cfg = _read_json(cfg_path, where) if cfg_path.is_file() else {}

    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    to_add: list[AddedToken] = []
    decoder_cfg = cfg.get("added_tokens_decoder")
    if isinstance(decoder_cfg, Mapping):
        for _, value in sorted(decoder_cfg.items(), key=lambda kv: int(kv[0])):
            at = _added_token(
                value, special=bool(value.get("special", False)) if isinstance(value, Mapping) else False
            )
            if at is not None and at.content not in present:
                to_add.append(at)
                present.add(at.content)

    special_map: dict[str, str] = {}
    for attr in SPECIAL_TOKEN_ATTRS:
        content = _token_content(cfg.get(attr))
        if content is None:
            continue
        special_map[attr] = content
        if content not in present:
            at = _added_token(cfg.get(attr), special=True)
            assert at is not None
            at.special = True
            to_add.append(at)
            present.add(content)
    extra = cfg.get("extra_special_tokens", cfg.get("additional_special_tokens"))
    if isinstance(extra, Mapping):
        extra = list(extra.values())
    if isinstance(extra, list):
        for value in extra:
            at = _added_token(value, special=True)
            if at is not None and at.content not in present:
                at.special = True
                to_add.append(at)
                present.add(at.content)
    if to_add:
        tok.add_tokens(to_add)

    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = bool(cfg.get("split_special_tokens", False))

    chat_template, named = _templates(folder, cfg, where)
    if chat_template_override is not None:
        chat_template, named = chat_template_override, {}
    return TokenizerFiles(
        tokenizer=tok, special_tokens=special_map, chat_template=chat_template, named_templates=named
    )
