"""gateway/documents.read_document: a document, or a failure in the reader's own terms; the
tokenizer files' messages built on it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gateway.agent_credentials import CredentialsError, _read_token_file
from gateway.api_keys import ApiKeys, ApiKeysError
from gateway.config import ApiKeysConfig
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


@pytest.mark.parametrize("kind", ["JSON", "YAML"])
def test_a_document_not_in_utf8_is_failed_with_where(tmp_path: Path, kind: str) -> None:
    (tmp_path / "doc").write_bytes(b'{"a": "caf\xe9"}')  # Latin-1, as an editor may save it
    with pytest.raises(Failed, match=r"^not UTF-8 text: byte 10 \(invalid continuation byte\)$"):
        read_document(tmp_path / "doc", kind, Failed)  # type: ignore[arg-type]


def test_files_read_as_text_fail_in_their_readers_terms(tmp_path: Path) -> None:
    """The API-key file, the agent-token file and a chat template: each a failure naming its
    setting and file, never a bare UnicodeDecodeError (a traceback at start-up or reload)."""
    bad = tmp_path / "latin1"
    bad.write_bytes(b"caf\xe9\n")
    with pytest.raises(ApiKeysError, match=rf"^auth.api_keys.file: {bad}: not UTF-8 text: byte 3 "):
        ApiKeys.of(ApiKeysConfig(file=str(bad)), {})
    with pytest.raises(CredentialsError, match=rf"^auth.agent_token_file: {bad}: not UTF-8 text"):
        _read_token_file(str(bad))
    shutil.copytree(TINY, tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_bytes(b"{{ 'caf\xe9' }}")
    with pytest.raises(FeatureConfigError, match=r"^models\[0\].tokenizer: .*chat_template.jinja: not UTF-8"):
        load_tokenizer_files(tmp_path / "tok", where="models[0].tokenizer")
