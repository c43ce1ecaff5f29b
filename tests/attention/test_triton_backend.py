"""The Triton attention backend against the torch reference backend, step by step.

Both backends get the same step (mixed decodes, prefills, chunked-prefill continuations
and single-token rows after the first prefill; GQA; block size 16; shuffled block
tables) and must write the same cache slots and produce the same output. The Triton
side's cache starts as NaN except for the cached context, and in the sliding-window
cases its block tables drop the blocks that fell out of every query's window (-1,
clamped by the metadata to block 0, which is NaN and belongs to nobody): reading
anything it must not see would show. On the CPU the backend runs under
``TRITON_INTERPRET=1`` in a subprocess (see tests/kernels/test_paged_attention.py for
why); the ``gpu`` test runs it compiled at model-like sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import pytest
import torch

from cvllm.attention.backends import torch_ref
from cvllm.attention.interface import AttentionParams
from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata, RopeInputs
from tests.interpreted import run_interpreted

MIXED = [(9, 1), (0, 1), (30, 1), (0, 13), (7, 5), (21, 1), (0, 2), (40, 3)]
"""(cached context, new tokens): three decodes, then prefills, chunks and a decode row."""


@dataclass
class Step:
    q: torch.Tensor  # [T, H, D] (T includes padding rows)
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [N, bs, Hkv, D]: context written, zeros elsewhere
    v_cache: torch.Tensor
    context_slots: torch.Tensor  # [C] slots holding cached context
    step_slots: np.ndarray  # [n] slots of this step's tokens
    query_start_loc: np.ndarray  # [B+1]
    seq_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, M], padded with -1


def build_step(seqs: List[Tuple[int, int]], bs: int, heads: Tuple[int, int], d: int,
               dtype=torch.float32, seed=0, pad=0) -> Step:
    """A step on the CPU; block 0 is never allocated (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    per_seq = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = sum(per_seq) + 4
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = np.full((len(seqs), max(per_seq) + 2), -1, dtype=np.int32)
    kc = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype)  # [N, bs, Hkv, D]
    vc = torch.zeros_like(kc)
    ctx_slots, step_slots, qs, ks, vs = [], [], [], [], []
    for b, (c, n) in enumerate(seqs):
        tables[b, : per_seq[b]] = [free.pop() for _ in range(per_seq[b])]
        pos = np.arange(c + n)
        slots = tables[b][pos // bs].astype(np.int64) * bs + pos % bs  # [c+n]
        kk = torch.randn(c + n, hkv, d, generator=g).to(dtype)  # [c+n, Hkv, D]
        vv = torch.randn(c + n, hkv, d, generator=g).to(dtype)
        torch_ref.write_kv(kk[:c], vv[:c], KVCache(kc, vc), torch.from_numpy(slots[:c]))
        ctx_slots.append(slots[:c])
        step_slots.append(slots[c:])
        ks.append(kk[c:])
        vs.append(vv[c:])
        qs.append(torch.randn(n, h, d, generator=g).to(dtype))

    def extra(x):  # padding rows past num_tokens
        return torch.cat([x, torch.randn(pad, *x.shape[1:], generator=g).to(dtype)])

    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])])
    return Step(extra(torch.cat(qs)), extra(torch.cat(ks)), extra(torch.cat(vs)), kc, vc,
                torch.from_numpy(np.concatenate(ctx_slots)), np.concatenate(step_slots),
                qsl, np.array([c + n for c, n in seqs]), tables)


def free_out_of_window(step: Step, bs: int, window: int) -> np.ndarray:
    """The block tables with every block that no query of its sequence can see set to -1."""
    tables = step.block_tables.copy()
    qlens = np.diff(step.query_start_loc)
    for b, (seq_len, qlen) in enumerate(zip(step.seq_lens, qlens)):
        first_visible = max(int(seq_len - qlen) - window + 1, 0)
        tables[b, : first_visible // bs] = -1
    return tables


def run_case(seqs, bs=16, heads=(4, 2), d=16, dtype=torch.float32, device="cpu", seed=0,
             pad=0, sliding_window: Optional[int] = None, softcap: Optional[float] = None,
             atol=2e-5) -> None:
    from cvllm.attention.backends import triton_backend

    s = build_step(seqs, bs, heads, d, dtype, seed, pad)
    slots = np.concatenate([s.step_slots, np.full(pad, -1)])

    def meta(tables):
        return AttentionMetadata.build(slot_mapping=slots, query_start_loc=s.query_start_loc,
                                       seq_lens=s.seq_lens, block_tables=tables, device=device,
                                       sliding_window=sliding_window)

    tables = free_out_of_window(s, bs, sliding_window) if sliding_window else s.block_tables
    to = lambda x: x.to(device)  # noqa: E731
    q, k, v = to(s.q), to(s.k), to(s.v)
    ref_k, ref_v = to(s.k_cache), to(s.v_cache)
    tri_k, tri_v = (torch.full_like(c, float("nan")) for c in (ref_k, ref_v))
    for tri, ref in ((tri_k, ref_k), (tri_v, ref_v)):
        flat = tri.view(-1, *tri.shape[2:])  # [N*bs, Hkv, D]
        flat[to(s.context_slots)] = ref.view(-1, *ref.shape[2:])[to(s.context_slots)]
    params = AttentionParams(d**-0.5, sliding_window, softcap)
    want = torch_ref.forward(q, k, v, KVCache(ref_k, ref_v), meta(s.block_tables), params)
    got = triton_backend.forward(q, k, v, KVCache(tri_k, tri_v), meta(tables), params)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=atol)
    if pad:
        assert torch.all(got[-pad:] == 0)
    used = to(torch.from_numpy(np.concatenate([s.context_slots.numpy(), s.step_slots])))
    for tri, ref in ((tri_k, ref_k), (tri_v, ref_v)):  # the write path is exact
        assert torch.equal(tri.view(-1, *tri.shape[2:])[used], ref.view(-1, *ref.shape[2:])[used])
    assert triton_backend.TritonAttentionBackend.name == "triton"
    assert triton_backend.TritonAttentionBackend.capabilities.fused_rope


def run_rope_case(seqs, bs=16, heads=(4, 2), d=16, dtype=torch.float32, device="cpu", seed=0,
                  pad=0, neox=True, rot_dim=None) -> None:
    """``forward(..., rope=)`` (one kernel rotates q, k and writes the cache) against the
    rotary kernel followed by ``forward``: the same outputs, caches and rotated q / k,
    bit for bit; padding rows are rotated too but write nothing."""
    from cvllm.attention.backends import triton_backend
    from cvllm.kernels.rotary import rotary_embedding

    s = build_step(seqs, bs, heads, d, dtype, seed, pad)
    slots = np.concatenate([s.step_slots, np.full(pad, -1)])
    meta = AttentionMetadata.build(slot_mapping=slots, query_start_loc=s.query_start_loc,
                                   seq_lens=s.seq_lens, block_tables=s.block_tables,
                                   device=device)
    rot_dim = rot_dim or d
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.arange(256).float()[:, None] * inv_freq[None, :]  # [P, rot/2]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)  # [P, rot_dim]
    positions = torch.randint(0, 256, (s.q.shape[0],), generator=torch.Generator().manual_seed(9))
    rope = RopeInputs(positions.to(device), cache, d, neox)
    runs = []
    for fused in (True, False):
        q, k, v = (x.to(device).clone() for x in (s.q, s.k, s.v))
        kc, vc = (torch.full_like(c.to(device), float("nan")) for c in (s.k_cache, s.v_cache))
        for tri, ref in ((kc, s.k_cache), (vc, s.v_cache)):
            tri.view(-1, *tri.shape[2:])[s.context_slots] = ref.view(-1, *ref.shape[2:]).to(
                device)[s.context_slots]
        if not fused:
            rotary_embedding(rope.positions, q, k, cache, d, neox)
        out = triton_backend.forward(q, k, v, KVCache(kc, vc), meta, AttentionParams(d**-0.5),
                                     rope if fused else None)
        runs.append((out, q, k, kc.nan_to_num(), vc.nan_to_num()))
    for got, want in zip(*runs):
        assert torch.equal(got, want)


CPU_CASES = [
    dict(seqs=MIXED),
    dict(seqs=MIXED, heads=(8, 1), sliding_window=5, softcap=2.0, seed=1),
    dict(seqs=[(3, 1), (0, 6), (17, 9)], heads=(4, 4), d=24, pad=3, seed=2),  # MHA, padding
    dict(seqs=[(5, 1), (16, 1), (0, 1), (40, 1)], seed=3, sliding_window=20),  # decodes only
    dict(seqs=[(0, 17), (16, 16)], seed=4, softcap=5.0),  # prefill and chunk only
]


def run_cpu_cases() -> None:
    """Entry point of the interpreter subprocess."""
    for i, case in enumerate(CPU_CASES):
        try:
            run_case(**case)
        except Exception as e:  # say which case failed, keep the traceback
            raise AssertionError(f"CPU case {i}: {case}") from e
    run_rope_case(MIXED, pad=2)
    run_rope_case([(3, 1), (0, 6)], heads=(6, 3), d=24, rot_dim=8, neox=False, seed=1)


def test_backend_matches_torch_ref_interpreted_on_cpu():
    code = "from tests.attention.test_triton_backend import run_cpu_cases; run_cpu_cases()"
    run_interpreted(code)


def test_rejects_short_block_tables():
    from cvllm.attention.backends import triton_backend

    s = build_step([(20, 1)], 16, (4, 2), 16)
    meta = AttentionMetadata.build(slot_mapping=s.step_slots, query_start_loc=s.query_start_loc,
                                   seq_lens=s.seq_lens, block_tables=s.block_tables[:, :1],
                                   device="cpu")
    with pytest.raises(ValueError, match="block_tables"):
        triton_backend.forward(s.q, s.k, s.v, KVCache(s.k_cache, s.v_cache), meta,
                               AttentionParams(0.25))


GPU_MIXED = [(100, 1), (0, 1), (3000, 1), (5000, 1), (0, 700), (512, 300), (60, 1), (0, 2),
             (2048, 64)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,atol,heads,d", [
    (torch.bfloat16, 2e-2, (32, 8), 128), (torch.float16, 4e-3, (32, 8), 128),
    (torch.float32, 1e-4, (32, 8), 128), (torch.bfloat16, 2e-2, (8, 4), 256),
    (torch.bfloat16, 2e-2, (16, 16), 64),
])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 256, "softcap": 30.0},
                                  {"sliding_window": 4096}])
def test_backend_matches_torch_ref_cuda(dtype, atol, heads, d, opts):
    run_case(GPU_MIXED, 16, heads, d, dtype, "cuda", pad=5, atol=atol, **opts)
    run_case([(4000, 1)] * 3, 16, heads, d, dtype, "cuda", atol=atol, **opts)  # split-K decodes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads,d", [((32, 8), 128), ((8, 1), 256)])
def test_fused_rope_matches_rotary_then_forward_cuda(heads, d):
    run_rope_case(GPU_MIXED, 16, heads, d, torch.bfloat16, "cuda", pad=5)
    run_rope_case([(300, 1)], 16, heads, d, torch.bfloat16, "cuda")  # batch-1 decode
