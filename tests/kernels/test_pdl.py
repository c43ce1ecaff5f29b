"""``kernels/pdl.py``'s early-trigger sites (``CVLLM_PDL_EARLY``): parsed, refused when
unknown, and never on where PDL is off (the CPU). Where the trigger lands in the compiled
kernels: tests/kernels/test_ggml_compile.py."""

import os
import subprocess
import sys

import pytest
import torch

from cvllm.kernels import pdl


def test_sites_parse_and_refuse_unknown_names():
    assert pdl._sites("qkv, q8,norm") == frozenset({"qkv", "q8", "norm"})
    assert pdl._sites("0") == frozenset() and pdl._sites("") == frozenset()
    with pytest.raises(ValueError, match="unknown sites.*'gate'.*known: qkv, mlp"):
        pdl._sites("qkv,gate")


def test_early_trigger_needs_pdl_and_a_named_site():
    x = torch.zeros(4)  # CPU: no PDL, so no site triggers early
    assert not any(pdl.early_trigger(x, s) for s in pdl.SITES)


def test_default_sites_and_a_bad_variable_from_a_fresh_process():
    code = "from cvllm.kernels import pdl; print(sorted(pdl.EARLY))"
    env = {k: v for k, v in os.environ.items() if k != "CVLLM_PDL_EARLY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['norm', 'q8', 'qkv']"
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "CVLLM_PDL_EARLY": "up"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "CVLLM_PDL_EARLY names unknown sites ['up']" in bad.stderr
