"""The CUDA-graph and attention-backend options from the command line to the config:
``--disable-cuda-graph`` / ``--attention-backend`` reach ``build_llm_engine``, and a bad
backend name is refused before anything loads."""

import pytest
from click.testing import CliRunner

from cvllm import cli
from cvllm.config import (CacheConfig, ConfigError, DeviceConfig, EngineConfig, ModelConfig,
                          SchedulerConfig)
from cvllm.engine import builder


def test_flags_are_documented_and_passed_through(monkeypatch):
    help_text = CliRunner().invoke(cli.main, ["serve", "--help"]).output
    assert "--disable-cuda-graph" in help_text and "--attention-backend" in help_text
    seen = {}

    def fake_build(**kw):
        seen.update(kw)
        raise ConfigError("stop here")

    monkeypatch.setattr(builder, "build_llm_engine", fake_build)
    result = CliRunner().invoke(cli.main, ["generate", "--prompt", "hi", "--disable-cuda-graph",
                                           "--attention-backend", "torch_ref"])
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen["disable_cuda_graph"] is True and seen["attention_backend"] == "torch_ref"
    CliRunner().invoke(cli.main, ["generate", "--prompt", "hi"])
    assert seen["disable_cuda_graph"] is False and seen["attention_backend"] == "auto"
    assert seen["cuda_graph_max_tokens"] == 512
    CliRunner().invoke(cli.main, ["generate", "--prompt", "hi", "--cuda-graph-max-tokens", "0"])
    assert seen["cuda_graph_max_tokens"] == 0
    result = CliRunner().invoke(cli.main, ["generate", "--prompt", "hi",
                                           "--cuda-graph-max-tokens", "-1"])
    assert result.exit_code == 2 and "--cuda-graph-max-tokens" in result.output


def test_negative_cuda_graph_max_tokens_is_refused():
    hf = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, vocab_size=16)
    with pytest.raises(ConfigError, match="--cuda-graph-max-tokens"):
        EngineConfig(model=ModelConfig("X", hf), cache=CacheConfig(), scheduler=SchedulerConfig(),
                     device=DeviceConfig(), cuda_graph_max_tokens=-1)


def test_bad_backend_is_refused():
    with pytest.raises(ConfigError, match="--attention-backend"):
        builder.build_llm_engine(attention_backend="flash")
    hf = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, vocab_size=16)
    with pytest.raises(ConfigError, match="--attention-backend"):
        EngineConfig(model=ModelConfig("X", hf), cache=CacheConfig(), scheduler=SchedulerConfig(),
                     device=DeviceConfig(), attention_backend="flash")
