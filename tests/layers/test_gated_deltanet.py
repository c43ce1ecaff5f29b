"""Gated DeltaNet math (layers/gated_deltanet.py) against its per-sequence references
(kernels/reference/deltanet.py) and against transformers' torch fallbacks in modeling_qwen3_next,
including mixed batches (decodes + prefills), reused slots and chunked continuation."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from cvllm.kernels.reference.deltanet import (
    causal_conv1d_ref, gated_delta_rule_ref, rms_norm_gated_ref,
)
from cvllm.layers.gated_deltanet import (
    RMSNormGated,
    causal_conv1d_varlen,
    chunk_gated_delta_rule,
    gated_delta_rule_varlen,
    prepare_qk,
)

HK, HV, DK, DV = 2, 4, 8, 6


def _qkvgb(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, HK, DK, generator=g)
    k = torch.randn(length, HK, DK, generator=g)
    v = torch.randn(length, HV, DV, generator=g)
    decay = -F.softplus(torch.randn(length, HV, generator=g))  # log decay <= 0
    beta = torch.rand(length, HV, generator=g)
    return q, k, v, decay, beta


def _meta(lens, slots, has_init):
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    num_decodes = 0
    while num_decodes < len(lens) and lens[num_decodes] == 1:
        num_decodes += 1
    return SimpleNamespace(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_start_loc_cpu=qsl,
        state_slots=torch.tensor(slots, dtype=torch.int64),
        has_initial_state=torch.tensor(has_init, dtype=torch.bool),
        num_decodes=num_decodes, num_tokens=int(qsl[-1]),
    )


def test_conv_ref_matches_transformers():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 5, generator=g), torch.randn(5, 4, generator=g)
    bias = torch.randn(5, generator=g)
    ours, state = causal_conv1d_ref(x, w, bias)
    theirs = hf.causal_conv1d_fn(x.t()[None], w, bias, activation="silu")[0].t()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # one more token from the state: transformers keeps K inputs, we keep K-1
    nxt = torch.randn(1, 5, generator=g)
    ours1, _ = causal_conv1d_ref(nxt, w, bias, state)
    hf_state = torch.cat([x.t()[:, -4:]], dim=1)[None].clone()  # [1, C, K]
    theirs1 = hf.causal_conv1d_update(nxt.t()[None], hf_state, w, bias, "silu")[0].t()
    torch.testing.assert_close(ours1, theirs1, rtol=1e-5, atol=1e-6)


def test_delta_rule_ref_matches_transformers_recurrent():
    q, k, v, decay, beta = _qkvgb(11)
    init = torch.randn(HV, DK, DV)
    ours, s = gated_delta_rule_ref(q, k, v, decay, beta, init)
    theirs, hs = hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], decay[None], beta[None], initial_state=init[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, hs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length,chunk", [(1, 64), (13, 4), (70, 64), (8, 8)])
def test_chunked_delta_rule_matches_ref_and_transformers(length, chunk):
    q, k, v, decay, beta = _qkvgb(length, seed=length)
    init = torch.randn(HV, DK, DV)
    want, want_s = gated_delta_rule_ref(q, k, v, decay, beta, init)
    qp, kp = prepare_qk(q, k, HV)
    got, got_s = chunk_gated_delta_rule(qp, kp, v, decay, beta, init.clone(), chunk)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_s, want_s, rtol=1e-4, atol=1e-5)
    theirs, _ = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], decay[None], beta[None], chunk_size=chunk,
        initial_state=init[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got, theirs[0], rtol=1e-4, atol=1e-5)


def test_conv_varlen_mixed_batch_and_state_update():
    """Decodes first, then prefills: one continuing, one new in a reused (dirty) slot, one
    shorter than the kernel's history."""
    lens, slots, has_init = [1, 1, 5, 7, 2], [3, 0, 4, 1, 2], [True, False, True, False, False]
    C, K, S = 6, 4, 5
    g = torch.Generator().manual_seed(2)
    w, bias = torch.randn(C, K, generator=g), torch.randn(C, generator=g)
    states = torch.randn(S, C, K - 1, generator=g)
    x = torch.randn(sum(lens), C, generator=g)
    before = states.clone()
    meta = _meta(lens, slots, has_init)
    out = causal_conv1d_varlen(x, w, bias, states, meta.query_start_loc, meta.state_slots,
                               meta.has_initial_state)
    qsl = meta.query_start_loc_cpu
    for b, slot in enumerate(slots):
        xb = x[qsl[b]:qsl[b + 1]]
        want, want_state = causal_conv1d_ref(xb, w, bias, before[slot] if has_init[b] else None)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(states[slot], want_state)


def test_delta_rule_varlen_mixed_batch():
    lens, slots, has_init = [1, 1, 9, 3], [2, 5, 0, 3], [True, False, True, False]
    T = sum(lens)
    q, k, v, decay, beta = _qkvgb(T, seed=7)
    states = torch.randn(6, HV, DK, DV)
    before = states.clone()
    meta = _meta(lens, slots, has_init)
    out = gated_delta_rule_varlen(q, k, v, decay, beta, states, meta)
    qsl = meta.query_start_loc_cpu
    for b, slot in enumerate(slots):
        s, e = qsl[b], qsl[b + 1]
        want, want_s = gated_delta_rule_ref(q[s:e], k[s:e], v[s:e], decay[s:e], beta[s:e],
                                            before[slot] if has_init[b] else None)
        torch.testing.assert_close(out[s:e], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states[slot], want_s, rtol=1e-4, atol=1e-5)
    untouched = [i for i in range(6) if i not in slots]
    torch.testing.assert_close(states[untouched], before[untouched])


def test_chunked_prefill_then_decode_equals_whole_sequence():
    """The state carries across chunks of one sequence and into its decode steps."""
    L, C, K = 15, 2 * HK * DK + HV * DV, 4
    q, k, v, decay, beta = _qkvgb(L, seed=3)
    want, _ = gated_delta_rule_ref(q, k, v, decay, beta)
    x = torch.randn(L, C)
    w = torch.randn(C, K)
    want_conv, _ = causal_conv1d_ref(x, w)
    conv_states, ssm_states = torch.full((3, C, K - 1), 7.0), torch.full((3, HV, DK, DV), 7.0)
    got, got_conv, start = [], [], 0
    for n in (4, 4, 4, 1, 1, 1):
        meta = _meta([n], [1], [start > 0])
        sl = slice(start, start + n)
        got_conv.append(causal_conv1d_varlen(x[sl], w, None, conv_states, meta.query_start_loc,
                                             meta.state_slots, meta.has_initial_state))
        got.append(gated_delta_rule_varlen(q[sl], k[sl], v[sl], decay[sl], beta[sl], ssm_states,
                                           meta))
        start += n
    torch.testing.assert_close(torch.cat(got_conv), want_conv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-5)


def test_rms_norm_gated_matches_transformers():
    torch.manual_seed(0)
    x, z = torch.randn(5, 3, DV), torch.randn(5, 3, DV)
    theirs = hf.Qwen3NextRMSNormGated(DV, eps=1e-6)
    ours = RMSNormGated(DV, 1e-6)
    with torch.no_grad():
        theirs.weight.add_(torch.randn(DV) * 0.1)
        ours.weight.copy_(theirs.weight)
    torch.testing.assert_close(ours(x, z), theirs(x, z))
    torch.testing.assert_close(rms_norm_gated_ref(x, z, ours.weight, 1e-6), theirs(x, z))
