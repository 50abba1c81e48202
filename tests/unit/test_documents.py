"""gateway/documents.read_document: a document, or a failure in the reader's own terms; the
tokenizer files' messages built on it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gateway.documents import read_document
from gateway.features.tokenizer_files import FeatureConfigError, load_tokenizer_files

TINY = Path(__file__).resolve().parents[2] / "assets/tokenizers/kvgate-tiny"


class Failed(Exception):
    pass


@pytest.mark.parametrize("kind, text", [("JSON", '{"a": [1, 2]}'), ("YAML", "a: [1, 2]\n")])
def test_a_document_is_read_and_parsed(tmp_path: Path, kind: str, text: str) -> None:
    (tmp_path / "doc").write_text(text)
    assert read_document(tmp_path / "doc", kind, Failed) == {"a": [1, 2]}  # type: ignore[arg-type]


@pytest.mark.parametrize("kind, text", [("JSON", '{"a": [1, 2}'), ("YAML", "a: [1, 2\n")])
def test_a_document_that_does_not_parse_is_failed_with_its_kind(tmp_path: Path, kind: str, text: str) -> None:
    (tmp_path / "doc").write_text(text)
    with pytest.raises(Failed, match=rf"^invalid {kind}: "):
        read_document(tmp_path / "doc", kind, Failed)  # type: ignore[arg-type]


def test_a_missing_document_is_failed_with_the_reason() -> None:
    with pytest.raises(Failed, match=r"^cannot read: No such file or directory$"):
        read_document(Path("/nonexistent/kvgate/doc.json"), "JSON", Failed)


def test_a_broken_tokenizer_config_names_the_field_and_the_file(tmp_path: Path) -> None:
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": ')
    with pytest.raises(FeatureConfigError) as err:
        load_tokenizer_files(tmp_path, where="models[0].tokenizer")
    assert str(err.value).startswith(
        f"models[0].tokenizer: {tmp_path / 'tokenizer_config.json'}: invalid JSON: "
    )
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(FeatureConfigError, match=r"must hold a JSON object"):
        load_tokenizer_files(tmp_path, where="models[0].tokenizer")
