"""``kernels/pdl.py``'s early-trigger sites (``CVLLM_PDL_EARLY``, parsed by
``utils/tuning.py``): parsed, refused when unknown, and never on where PDL is off (the
CPU). Where the trigger lands in the compiled kernels: tests/kernels/test_ggml_compile.py."""

import pytest
import torch

from cvllm.kernels import pdl
from cvllm.utils import tuning


def _sites(text):
    return tuning.from_environ({"CVLLM_PDL_EARLY": text}).pdl_early


def test_sites_parse_and_refuse_unknown_names():
    assert _sites("qkv, q8,norm") == frozenset({"qkv", "q8", "norm"})
    assert _sites("0") == frozenset() and _sites("") == frozenset()
    with pytest.raises(ValueError, match="unknown sites.*'gate'.*known: qkv, mlp"):
        _sites("qkv,gate")


def test_early_trigger_needs_pdl_and_a_named_site():
    x = torch.zeros(4)  # CPU: no PDL, so no site triggers early
    with tuning.configure(pdl_early=frozenset(pdl.SITES)):
        assert not any(pdl.early_trigger(x, s) for s in pdl.SITES)


def test_default_sites_and_a_bad_variable():
    assert sorted(tuning.from_environ({}).pdl_early) == ['norm', 'q8', 'qkv']
    with pytest.raises(ValueError, match=r"CVLLM_PDL_EARLY names unknown sites \['up'\]"):
        _sites("up")
