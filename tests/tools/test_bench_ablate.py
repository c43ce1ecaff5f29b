"""tools/bench_ablate.py's critical-path attribution, on made-up kernel intervals (CPU)."""

from types import SimpleNamespace

import pytest

import bench_ablate


def _ev(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_critical_path_charges_each_kernel_what_it_moved_the_end():
    # Under PDL the GEMV starts (launch, first tile) long before the norm ends; start-based
    # busy time would charge it the overlap. By ends: norm 1, gemv 4 (10 - 6), attn 3; the
    # first GEMV from the span's start (the norm started first, and ends later).
    evs = [_ev("ggml_gemv_i8_kernel", 1.0, 5.0), _ev("_rms_norm_kernel", 0.0, 6.0),
           _ev("ggml_gemv_i8_kernel", 3.0, 10.0), _ev("_decode_kernel", 9.0, 13.0)]
    rows = {r["ops"]: r for r in bench_ablate.critical_path(evs, steps=1)}
    assert rows["gemv"]["us_per_step"] == pytest.approx(5.0)
    assert rows["gemv > norm"]["us_per_step"] == pytest.approx(1.0)
    assert rows["gemv > norm > gemv"]["us_per_step"] == pytest.approx(4.0)
    assert rows["gemv > norm > gemv > attn"]["us_each"] == pytest.approx(3.0)
    # the increments add up to the span (per step); a copy ending within the attention
    # kernel is charged from the GEMV's end to its own, the attention kernel the rest
    assert sum(r["us_per_step"] for r in rows.values()) == pytest.approx(13.0)
    inner = {r["ops"]: r["us_per_step"]
             for r in bench_ablate.critical_path(evs + [_ev("Memcpy DtoH", 11.0, 12.0)], 2)}
    assert sum(inner.values()) == pytest.approx(6.5)
    assert inner["gemv > norm > gemv > copy"] == pytest.approx(1.0)
    assert inner["norm > gemv > copy > attn"] == pytest.approx(0.5)


def test_short_names_tell_the_kernels_apart():
    assert bench_ablate._short("ggml_gemv_i8_q6_kernel") == "gemv"
    assert bench_ablate._short("ggml_gemv_kernel") == "fgemv"
    assert bench_ablate._short("_rotary_write_kv_kernel") == "rope"
    assert bench_ablate._short("void at::native::unrolled_elementwise_kernel<float>") == \
        "void at::native::unrolle"
