"""``utils/tuning.py``: every ``CVLLM_*`` tuning switch parsed from a mapping, its
defaults, a bad value refused naming its variable, read once, overridden by
``configure``."""

import pytest

from cvllm.utils import tuning

ALL_OFF = {"CVLLM_PDL": "0", "CVLLM_PDL_EARLY": "0", "CVLLM_FUSED_MERGE": "0",
           "CVLLM_GEMV_ACT": "0", "CVLLM_GEMV_PUSH": "0", "CVLLM_GGML_INT8_GEMV": "0",
           "CVLLM_GGML_I8_SPLIT": "0", "CVLLM_GGML_Q8_X": "0", "CVLLM_GGML_NORM_Q8": "0",
           "CVLLM_GGML_INT8_HEAD": "0", "CVLLM_ALLREDUCE": "nccl", "CVLLM_HOT_POLL_S": "0"}


def test_defaults():
    s = tuning.from_environ({})
    assert s == tuning.TuningSettings()
    assert (s.pdl, s.fused_merge, s.gemv_act, s.gemv_push, s.ggml_int8_gemv, s.ggml_i8_split,
            s.ggml_norm_q8, s.ggml_int8_head) == (True,) * 8
    assert s.pdl_early == {"qkv", "q8", "norm"} and s.ggml_q8_x == "gated"
    assert s.allreduce == "auto" and s.hot_poll_s is None


def test_every_switch_is_read():
    s = tuning.from_environ(ALL_OFF)
    assert not any((s.pdl, s.fused_merge, s.gemv_act, s.gemv_push, s.ggml_int8_gemv,
                    s.ggml_i8_split, s.ggml_norm_q8, s.ggml_int8_head))
    assert s.pdl_early == frozenset() and s.ggml_q8_x == "0"
    assert s.allreduce == "nccl" and s.hot_poll_s == 0.0
    s = tuning.from_environ({"CVLLM_PDL": " 1 ", "CVLLM_GGML_Q8_X": "ALL",
                             "CVLLM_ALLREDUCE": " ", "CVLLM_HOT_POLL_S": "2.5",
                             "CVLLM_PDL_EARLY": "rope, attn"})
    assert s.pdl and s.ggml_q8_x == "all" and s.allreduce == "auto" and s.hot_poll_s == 2.5
    assert s.pdl_early == {"rope", "attn"}
    assert not tuning.from_environ({"CVLLM_FUSED_MERGE": "false"}).fused_merge
    assert tuning.from_environ({"CVLLM_FUSED_MERGE": ""}).fused_merge  # empty: the default


@pytest.mark.parametrize("name,value", [
    ("CVLLM_PDL", "2"), ("CVLLM_GEMV_PUSH", "maybe"), ("CVLLM_PDL_EARLY", "up"),
    ("CVLLM_GGML_Q8_X", "some"), ("CVLLM_GGML_Q8_X", ""), ("CVLLM_ALLREDUCE", "symm"),
    ("CVLLM_HOT_POLL_S", "-1"), ("CVLLM_HOT_POLL_S", "nan"), ("CVLLM_HOT_POLL_S", "soon"),
])
def test_a_bad_value_names_its_variable(name, value):
    with pytest.raises(ValueError, match=name):
        tuning.from_environ({name: value})


def test_read_once_and_configured(monkeypatch):
    monkeypatch.setattr(tuning, "_CURRENT", None)
    monkeypatch.setenv("CVLLM_GGML_I8_SPLIT", "0")
    first = tuning.current()
    assert not first.ggml_i8_split
    monkeypatch.setenv("CVLLM_GGML_I8_SPLIT", "1")
    assert tuning.current() is first  # read once: later changes of the environment are not seen
    with tuning.configure(ggml_i8_split=True, pdl_early={"rope"}) as s:
        assert tuning.current() is s and s.ggml_i8_split and s.pdl_early == {"rope"}
        assert s.fused_merge == first.fused_merge  # the rest as before
        with tuning.configure(tuning.TuningSettings(fused_merge=False)):
            assert not tuning.current().fused_merge and tuning.current().ggml_i8_split
        assert tuning.current() is s
    assert tuning.current() is first
    with pytest.raises(ValueError, match="CVLLM_PDL_EARLY"):
        with tuning.configure(pdl_early={"up"}):
            pass
    assert tuning.current() is first


def test_the_settings_are_frozen():
    with pytest.raises(AttributeError):
        tuning.current().pdl = False
