"""The configured models as the featurizer uses them (docs/architecture.md, "Request path":
features): each model's tokenizer files, segment encoder and compiled chat templates, and the
names a request may use (the model's and its LoRA adapters').

Built once per featurizer from ``models``; a tokenizer folder shared by several models (without
a chat template override) is loaded once. Raises ``FeatureConfigError`` naming the config field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.config import ModelConfig
from gateway.features.chat_template import ChatTemplate, make_environment
from gateway.features.memo_cache import MemoCache
from gateway.features.segment_encoder import BoundedLRU, SegmentEncoder
from gateway.features.tokenizer_files import FeatureConfigError, TokenizerFiles, load_tokenizer_files
from gateway.request_errors import InvalidRequestError, UnknownModelError


@dataclass(frozen=True, slots=True)
class LocalTokenizer:
    """A model tokenized here: exact tokens, rendered and encoded as vLLM + transformers do."""

    files: TokenizerFiles
    encoder: SegmentEncoder
    templates: dict[str, ChatTemplate]  # by template source
    vocab_size: int

    def template(self, has_tools: bool) -> ChatTemplate:
        source = self.files.template_for(has_tools)
        if source is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        return self.templates[source]


@dataclass(frozen=True, slots=True)
class Model:
    config: ModelConfig
    local: LocalTokenizer | None  # set when ``tokenizer`` is a folder

    @property
    def remote(self) -> bool:
        return self.config.tokenizer == "remote"


@dataclass(frozen=True, slots=True)
class Resolved:
    """The model a request named: the base model and the adapter (None: the base itself)."""

    model: Model
    lora: str | None
    requested: str  # the name as the request gave it


def _resolve_path(path: str, base_dir: Path | None) -> Path:
    p = Path(path)
    return base_dir / p if not p.is_absolute() and base_dir is not None else p


def _read_override(mc: ModelConfig, where: str, base_dir: Path | None) -> str | None:
    if mc.chat_template is None:
        return None
    tpath = _resolve_path(mc.chat_template, base_dir)
    try:
        return tpath.read_text(encoding="utf-8")
    except OSError as exc:
        raise FeatureConfigError(f"{where}.chat_template: cannot read {tpath}: {exc.strerror}") from None


class ModelRegistry:
    def __init__(
        self,
        models: Sequence[ModelConfig],
        cache: BoundedLRU,
        *,
        remote_available: bool,
        base_dir: Path | None = None,
        memo: MemoCache | None = None,
    ) -> None:
        self._cache = cache
        self._memo = memo  # chat templates' outputs remembered (memo_cache.py)
        self._base_dir = base_dir
        self._loaded: dict[Path, LocalTokenizer] = {}
        self._by_name: dict[str, Resolved] = {}
        for i, mc in enumerate(models):
            where = f"models[{i}]"
            if mc.tokenizer == "remote" and not remote_available:
                raise FeatureConfigError(f"{where}.tokenizer: 'remote' needs a replica to ask (none given)")
            local = None if mc.tokenizer in (None, "remote") else self._local(mc, where)
            model = Model(config=mc, local=local)
            for name, lora in [(mc.name, None), *((a, a) for a in mc.lora_adapters)]:
                if name in self._by_name:
                    raise FeatureConfigError(
                        f"{where}.lora_adapters: name {name!r} is already a model or adapter"
                    )
                self._by_name[name] = Resolved(model, lora, name)

    def _local(self, mc: ModelConfig, where: str) -> LocalTokenizer:
        assert mc.tokenizer is not None
        folder = _resolve_path(mc.tokenizer, self._base_dir)
        override = _read_override(mc, where, self._base_dir)
        key = folder.resolve()
        if override is None and key in self._loaded:
            return self._loaded[key]
        files = load_tokenizer_files(folder, where=f"{where}.tokenizer", chat_template_override=override)
        env = make_environment()
        templates: dict[str, ChatTemplate] = {}
        for source in {files.chat_template, *files.named_templates.values()}:
            if source is None:
                continue
            try:
                templates[source] = ChatTemplate(source, files.special_tokens, env, self._memo)
            except ValueError as exc:
                raise FeatureConfigError(f"{where}.tokenizer: {exc}") from None
        local = LocalTokenizer(
            files=files,
            encoder=SegmentEncoder(files.tokenizer, self._cache, f"{key}#{len(self._loaded)}"),
            templates=templates,
            vocab_size=files.tokenizer.get_vocab_size(with_added_tokens=True),
        )
        if override is None:
            self._loaded[key] = local
        return local

    def names(self) -> list[str]:
        return list(self._by_name)

    def resolve(self, name: str) -> Resolved:
        """The model ``name`` (a model or an adapter) stands for (raises ``UnknownModelError``)."""
        found = self._by_name.get(name)
        if found is None:
            raise UnknownModelError(name)
        return found
