"""The command line: every bad flag ends start-up at once with one clear line (exit 2),
before any model is loaded; --version and python -m work."""

import subprocess
import sys

import pytest
from click.testing import CliRunner

from cvllm import __version__
from cvllm.cli import main

BAD_FLAGS = [
    (["--block-size", "7"], "--block-size"),
    (["--gpu-memory-fraction", "1.5"], "--gpu-memory-fraction"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--prefill-chunk-size", "-1"], "--prefill-chunk-size"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--mem", "0"], "--mem"),
    (["--max-model-len", "-5"], "--max-model-len"),
    (["--temperature", "5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--d", "a,b"], "--device-ids"),
    (["--port", "70000"], "--port"),
    (["--f", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    (["--w", "/nonexistent/folder"], "/nonexistent/folder"),
]


@pytest.mark.parametrize("args,needle", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_fails_clearly(args, needle):
    res = CliRunner().invoke(main, ["serve", "--cpu", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output


def test_bad_dtype_rejected_by_click():
    res = CliRunner().invoke(main, ["serve", "--dtype", "f8"])
    assert res.exit_code == 2 and "--dtype" in res.output


def test_version():
    res = CliRunner().invoke(main, ["--version"])
    assert res.exit_code == 0 and __version__ in res.output


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "cvllm", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout


def test_serve_help_lists_candle_aliases():
    res = CliRunner().invoke(main, ["serve", "--help"])
    for flag in ("--w, --weight-path", "--f, --weight-file", "--m, --model-id", "--h, --host",
                 "--p, --port", "--mem, --kvcache-mem-gpu", "--d, --device-ids"):
        assert flag in res.output


@pytest.mark.slow
def test_generate_offline(default_gguf):
    res = CliRunner().invoke(main, ["generate", "--cpu", "--f", str(default_gguf), "--temperature", "0",
                                    "--max-model-len", "256", "--max-tokens", "12", "--json",
                                    "--prompt", "What is the capital of France?"])
    assert res.exit_code == 0, res.output
    import json

    line = [ln for ln in res.output.splitlines() if ln.startswith("{")][-1]
    rec = json.loads(line)
    assert "Paris" in rec["text"] and rec["num_tokens"] <= 12


def test_bad_tuning_switch_fails_before_loading(monkeypatch):
    """A ``CVLLM_*`` kernel switch with a bad value ends start-up with exit 2 naming the
    variable, on a CPU run too (where no kernel would ever read it)."""
    from cvllm.utils import tuning

    monkeypatch.setenv("CVLLM_PDL_EARLY", "qkv,nowhere")
    monkeypatch.setattr(tuning, "_CURRENT", None)
    res = CliRunner().invoke(main, ["generate", "--cpu", "--f", "/nonexistent/model.gguf",
                                    "--prompt", "hi"])
    assert res.exit_code == 2, res.output
    assert "CVLLM_PDL_EARLY" in res.output and "Traceback" not in res.output
