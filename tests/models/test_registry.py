import pytest

from cvllm.models.registry import (
    UnsupportedArchitectureError,
    get_model_class,
    supported_architectures,
)


def test_known_architectures_resolve_lazily():
    assert "LlamaForCausalLM" in supported_architectures()
    cls = get_model_class("LlamaForCausalLM")
    assert cls.__name__ == "LlamaForCausalLM" and cls.__module__ == "cvllm.models.llama"
    assert issubclass(get_model_class("MistralForCausalLM"), cls)


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitectureError, match="supported: .*LlamaForCausalLM") as e:
        get_model_class("GPT2LMHeadModel")
    assert isinstance(e.value, ValueError) and "GPT2LMHeadModel" in str(e.value)
