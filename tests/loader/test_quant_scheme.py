"""The loader chooses the quantization scheme (``loader/quant_scheme.py``), one
``QuantizationConfig`` that reaches the model constructor through ``EngineConfig.quant``:

- a GGUF file: its tensor types (float tensors stay float); ``--dequantize``: None;
- ``--isq`` on an HF folder: every layer at that type; on a GGUF file, or an unknown
  name: refused with the flag's message; an HF folder without it: None;
- a checkpoint whose config.json carries a ``quantization_config``: refused before any
  weight loads, naming its ``quant_method``, unless ``quantization/registry.py`` has a
  format for it, whose factory then builds the config from that object;
- ``--cpu-dense-gb`` is checked whatever the weights are, and the batch-copy budget is
  made when the model's first layer asks (not when the config is chosen).
"""

from __future__ import annotations

import json

import gguf
import pytest

from cvllm import loader
from cvllm.config import ConfigError
from cvllm.kernels.quant.ggml_types import GgmlType
from cvllm.loader import ModelLoadError, ModelSource
from cvllm.quantization import registry
from cvllm.quantization.base import QuantizationConfig
from cvllm.quantization.gguf import GGUFQuantConfig

Q8 = gguf.GGMLQuantizationType.Q8_0
UP = "model.layers.0.mlp.up_proj.weight"


def _choose(source, **kw):
    return loader.quantization_config(source, loader.load_model_config(source), **kw)


def test_gguf_tensor_types_or_dequantized(make_tiny_gguf):
    _, path = make_tiny_gguf("llama", quant={UP: Q8})
    source = ModelSource("gguf", path)
    quant = _choose(source)
    assert isinstance(quant, GGUFQuantConfig) and quant.get_name() == "gguf"
    assert quant.tensor_types[UP] == GgmlType.Q8_0
    assert quant.tensor_types["model.layers.0.mlp.gate_proj.weight"] == GgmlType.F32
    assert quant.mapping  # the model class's stacked_params_mapping (fused qkv, gate_up)
    assert _choose(source, dequantize=True) is None


def test_isq_on_a_folder_and_its_refusals(tiny_llama_dir, make_tiny_gguf):
    folder = ModelSource("hf", tiny_llama_dir())
    assert _choose(folder) is None
    quant = _choose(folder, isq="q4_k", cpu_dense_gib=0.5)
    assert isinstance(quant, GGUFQuantConfig) and quant.get_name() == "isq:Q4_K"
    with pytest.raises(ConfigError, match="unknown --isq type 'q7k'"):
        _choose(folder, isq="q7k")
    _, path = make_tiny_gguf("llama")
    with pytest.raises(ConfigError, match="is a GGUF file"):
        _choose(ModelSource("gguf", path), isq="q4k")
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="--cpu-dense-gb"):
            _choose(folder, cpu_dense_gib=bad)  # float weights: checked all the same


def _with_quantization_config(folder, checkpoint):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = checkpoint
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_checkpoint_quantization_config_is_refused_before_loading(tiny_llama_dir):
    from cvllm.engine.builder import build_engine_config

    folder = _with_quantization_config(tiny_llama_dir(), {"quant_method": "GPTQ", "bits": 4})
    with pytest.raises(ModelLoadError, match=r"quantization_config \(gptq\).*cannot read"):
        build_engine_config(weight_path=str(folder), cpu=True)
    with pytest.raises(ModelLoadError, match="an unnamed method"):
        _choose(ModelSource("hf", _with_quantization_config(folder, {"bits": 4})))


def test_a_registered_format_builds_the_config(tiny_llama_dir, monkeypatch):
    class FakeConfig(QuantizationConfig):
        def __init__(self, checkpoint):
            self.checkpoint = checkpoint

        def get_name(self):
            return "fake"

        def get_quant_method(self, layer, prefix):
            return None

    monkeypatch.setitem(registry.CHECKPOINT_FORMATS, "fake", FakeConfig)
    checkpoint = {"quant_method": "Fake", "bits": 3}
    folder = _with_quantization_config(tiny_llama_dir(), checkpoint)
    quant = _choose(ModelSource("hf", folder))
    assert isinstance(quant, FakeConfig) and quant.checkpoint == checkpoint


def test_batch_copy_budget_is_made_when_the_model_asks(make_tiny_gguf):
    _, path = make_tiny_gguf("llama", quant={UP: Q8})
    quant = _choose(ModelSource("gguf", path), cpu_dense_gib=1.0)
    assert quant._budget is None and quant.loaded_note() == ""
    assert quant.budget.left == 2**30 and quant.budget is quant.budget
