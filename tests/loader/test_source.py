"""Resolving --w / --f / --m (and no flag) to a ModelSource."""

from __future__ import annotations

import types

import pytest

from cvllm.loader import ModelLoadError, ModelSource, resolve_model_source


def test_hf_folder(tiny_llama_dir):
    folder = tiny_llama_dir()
    assert resolve_model_source(weight_path=folder) == ModelSource("hf", folder)
    assert resolve_model_source(weight_path=str(folder)).name == folder.name


def test_folder_with_one_gguf(make_tiny_gguf):
    _, path = make_tiny_gguf()
    src = resolve_model_source(weight_path=path.parent)
    assert src.kind == "gguf" and src.path == path and src.tokenizer_path is None
    assert src.name == "tiny"


def test_folder_with_two_ggufs(make_tiny_gguf):
    _, a = make_tiny_gguf(name="a.gguf")
    make_tiny_gguf(name="b.gguf")
    with pytest.raises(ModelLoadError, match="several GGUF files.*--f"):
        resolve_model_source(weight_path=a.parent)


def test_gguf_file_and_w_path_as_weight_file(make_tiny_gguf):
    _, path = make_tiny_gguf()
    assert resolve_model_source(weight_file=path) == ModelSource("gguf", path)
    assert resolve_model_source(weight_path=path) == ModelSource("gguf", path)


def test_w_folder_with_f_name_inside_it(make_tiny_gguf, tmp_path):
    _, path = make_tiny_gguf()
    (tmp_path / "tokenizer.json").write_text("{}")
    src = resolve_model_source(weight_path=tmp_path, weight_file=path.name)
    assert src == ModelSource("gguf", path, tmp_path)


def test_w_folder_without_tokenizer_next_to_f(make_tiny_gguf, tmp_path):
    _, path = make_tiny_gguf()
    other = tmp_path / "other"
    other.mkdir()
    assert resolve_model_source(weight_path=other, weight_file=path) == ModelSource("gguf", path)


def test_bad_flags(tmp_path, make_tiny_gguf):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_source(weight_path=tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_source(weight_file=tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="no config.json and no .gguf"):
        resolve_model_source(weight_path=tmp_path)
    st = tmp_path / "model.safetensors"
    st.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="expects a .gguf"):
        resolve_model_source(weight_file=st)
    with pytest.raises(ModelLoadError, match="not both"):
        resolve_model_source(weight_path=tmp_path, model_id="org/model")
    _, path = make_tiny_gguf()
    with pytest.raises(ModelLoadError, match="local file"):
        resolve_model_source(weight_file=path, model_id="org/model")


def test_hub_offline_and_not_cached(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="cannot download cvllm-test/no-such-model: offline "
                                             "and not in the Hugging Face cache"):
        resolve_model_source(model_id="cvllm-test/no-such-model")
    with pytest.raises(ModelLoadError, match="cannot download m.gguf from cvllm-test/x: offline"):
        resolve_model_source(model_id="cvllm-test/x", weight_file="m.gguf")


def test_hub_errors_are_explained(monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    def missing(*args, **kwargs):
        # Just what HfHubHTTPError reads from a response; the HTTP library varies by version.
        response = types.SimpleNamespace(headers={}, request=None, status_code=404)
        raise errors.RepositoryNotFoundError("404", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(ModelLoadError, match="no such model on the Hugging Face Hub"):
        resolve_model_source(model_id="org/missing")


def test_hub_snapshot_is_resolved_as_folder(monkeypatch, tiny_llama_dir):
    import huggingface_hub

    folder = tiny_llama_dir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(folder))
    assert resolve_model_source(model_id="org/tiny") == ModelSource("hf", folder)


def test_no_flags_gives_default_model(smollm2_gguf):
    src = resolve_model_source()
    assert src == ModelSource("gguf", smollm2_gguf)


def test_model_source_validates_kind(tmp_path):
    with pytest.raises(ValueError):
        ModelSource("onnx", tmp_path)
