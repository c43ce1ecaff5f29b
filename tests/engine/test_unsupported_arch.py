"""An HF folder whose config.json names an architecture cvllm does not serve ends start-up
at once (exit 2, no traceback) with a message listing every supported architecture."""

import json
import subprocess
import sys

from click.testing import CliRunner

from cvllm.cli import main
from cvllm.models.registry import supported_architectures


def _foo_folder(tmp_path):
    cfg = dict(architectures=["FooForCausalLM"], model_type="foo", hidden_size=64,
               num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
               max_position_embeddings=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _check(output: str):
    assert "unsupported model architecture 'FooForCausalLM'" in output, output
    for arch in supported_architectures():
        assert arch in output
    assert "Traceback" not in output


def test_generate_refuses_unknown_architecture(tmp_path):
    folder = _foo_folder(tmp_path)
    res = subprocess.run([sys.executable, "-m", "cvllm", "generate", "--w", str(folder), "--cpu",
                          "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    _check(res.stderr)


def test_serve_refuses_unknown_architecture_before_listening(tmp_path):
    args = ["serve", "--w", str(_foo_folder(tmp_path)), "--cpu", "--port", "1"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2
    _check(res.output)
