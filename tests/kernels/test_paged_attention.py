"""The paged-attention Triton kernels against their torch references.

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, which
triton reads when a kernel is decorated, so the cases run in a fresh subprocess and other
tests' triton state is untouched) with tiny shapes; on a CUDA machine the ``gpu`` tests
run them compiled with model-sized heads, long contexts (split-K) and bf16/fp16/fp32.

Every cache starts as NaN and only the slots a sequence owns are written, so a kernel
that reads a key it must not see (past ``seq_len``, out of the window, a padded table
entry) turns its output NaN instead of passing by luck. Block ids are a random
permutation, so block tables are never contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import pytest
import torch

from cvllm.kernels.reference import paged_attention as ref
from tests.interpreted import run_interpreted

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
OPTS = [{}, {"sliding_window": 7, "softcap": 3.0}]


@dataclass
class Paged:
    k_cache: torch.Tensor  # [N, bs, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, M] int32
    seq_lens: torch.Tensor  # [B] int32


def make_paged(seq_lens: List[int], block_size: int, num_kv_heads: int, head_dim: int,
               dtype=torch.float32, device="cpu", seed=0, spare_blocks=3) -> Paged:
    """Caches holding random K/V for ``seq_lens`` tokens per sequence, NaN elsewhere."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq, default=0) + 1, dtype=torch.int32)
    for b, nb in enumerate(per_seq):
        tables[b, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)  # [N, bs, Hkv, D]
    kc = torch.full(shape, float("nan"), dtype=dtype)
    vc = torch.full(shape, float("nan"), dtype=dtype)
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = tables[b].long()[pos // block_size] * block_size + pos % block_size
        k = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g)
        ref.write_kv_ref(k, v, kc, vc, slots)
    to = dict(device=device)
    return Paged(kc.to(**to), vc.to(**to), tables.to(**to),
                 torch.tensor(seq_lens, dtype=torch.int32, device=device))


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


# ----- cases (shared by the interpreter subprocesses and the GPU tests) -----------------------


def check_write_kv(device="cpu", dtype=torch.float32, T=9, hkv=2, d=16, bs=16):
    from cvllm.kernels import paged_attention as pa

    g = torch.Generator().manual_seed(1)
    n_blocks = -(-T // bs) + 2
    kc = torch.randn(n_blocks, bs, hkv, d, generator=g).to(dtype=dtype, device=device)
    vc = torch.randn(n_blocks, bs, hkv, d, generator=g).to(dtype=dtype, device=device)
    slots = torch.randperm(n_blocks * bs, generator=g)[:T]
    if T >= 3:  # a single-token batch has no room for padding tokens
        slots[1] = slots[-2] = -1  # padding tokens
    # K/V as strided views of a fused QKV projection, like the model passes them.
    qkv = torch.randn(T, 3 * hkv * d + 8, generator=g).to(dtype=dtype, device=device)
    k = qkv[:, : hkv * d].view(T, hkv, d)  # [T, Hkv, D]
    v = qkv[:, hkv * d : 2 * hkv * d].view(T, hkv, d)
    want_k, want_v = kc.clone(), vc.clone()
    ref.write_kv_ref(k, v, want_k, want_v, slots)
    pa.write_kv(k, v, kc, vc, slots.to(device))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def check_decode(seq_lens, heads: Tuple[int, int], d: int, bs=16, device="cpu",
                 dtype=torch.float32, num_splits: Optional[int] = None, seed=0, bound=0,
                 **opts):
    """``bound``: ``max_seq_len`` exceeds the longest sequence by that much, as a CUDA
    graph's (planned for ``max_model_len``) does, so most splits hold no keys."""
    from cvllm.kernels import paged_attention as pa
    from cvllm.kernels.paged_attention import decode as pd

    h, hkv = heads
    p = make_paged(seq_lens, bs, hkv, d, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), h, d, generator=g).to(dtype=dtype, device=device)  # [B, H, D]
    scale = d**-0.5
    want = ref.decode_attention_ref(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                    scale, **opts)
    top = max(seq_lens) + bound
    got = pa.decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale,
                              max_seq_len=top, num_splits=num_splits, fused_merge=False, **opts)
    assert_close(got, want, dtype)
    # The merge fused into the decode kernel: the last split of each group merges and
    # resets its counter, so a second call sees zeroed counters and the same output.
    fused = [pa.decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale,
                                 max_seq_len=top, num_splits=num_splits,
                                 fused_merge=True, **opts) for _ in range(2)]
    for buf in pd._TICKETS.get((q.device.type, q.device.index), []):
        assert int(buf.abs().sum()) == 0
    assert_close(fused[0], want, dtype)
    assert torch.equal(fused[0], fused[1])
    if bound:  # a padding row (no keys, as in a padded graph batch) comes out as zeros
        lens = torch.cat([p.seq_lens, p.seq_lens.new_zeros(1)])
        tables = torch.cat([p.block_tables, p.block_tables[:1]])
        q2 = torch.cat([q, q[:1]])
        for fm in (False, True):
            out = pa.decode_attention(q2, p.k_cache, p.v_cache, tables, lens, scale,
                                      max_seq_len=top, num_splits=num_splits, fused_merge=fm,
                                      **opts)
            assert torch.equal(out[-1], torch.zeros_like(out[-1]))
            assert_close(out[:-1], want, dtype)


def check_prefill(seqs, heads: Tuple[int, int], d: int, bs=16, device="cpu",
                  dtype=torch.float32, seed=0, lead=2, tail=3, **opts):
    """``seqs``: (cached context, new tokens) per sequence. The queries sit after ``lead``
    rows of other sequences and before ``tail`` padding rows, which must stay zero."""
    from cvllm.kernels import paged_attention as pa

    h, hkv = heads
    seq_lens = [c + n for c, n in seqs]
    p = make_paged(seq_lens, bs, hkv, d, dtype, device, seed)
    qsl = torch.tensor([lead] + [lead + sum(n for _, n in seqs[: i + 1]) for i in range(len(seqs))],
                       dtype=torch.int32, device=device)  # [B+1]
    T = int(qsl[-1]) + tail
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(T, h, d, generator=g).to(dtype=dtype, device=device)  # [T, H, D]
    scale = d**-0.5
    want = ref.prefill_attention_ref(q, p.k_cache, p.v_cache, p.block_tables, qsl, p.seq_lens,
                                     scale, **opts)
    got = pa.prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, qsl, p.seq_lens,
                               max(n for _, n in seqs), scale, **opts)
    assert_close(got, want, dtype)
    assert torch.all(got[:lead] == 0) and torch.all(got[T - tail :] == 0)


def check_merge(device="cpu", B=3, H=4, S=5, D=24):
    from cvllm.kernels import paged_attention as pa

    g = torch.Generator().manual_seed(2)
    part_out = torch.randn(B, H, S, D, generator=g)  # [B, H, S, D]
    part_lse = torch.randn(B, H, S, generator=g) * 4  # [B, H, S]
    part_lse[0, :, 1:] = float("-inf")  # empty splits
    part_out[0, :, 1:] = 0.0
    want = ref.merge_attention_partials_ref(part_out, part_lse)
    out = torch.empty(B, H, D, device=device)
    pa.merge_attention_partials(part_out.to(device), part_lse.to(device), out)
    assert_close(out, want, torch.float32)


DECODE_CPU = [
    dict(seq_lens=[1, 17, 40, 33], heads=(4, 2), d=16),
    dict(seq_lens=[1, 17, 40, 33], heads=(4, 2), d=16, num_splits=3),
    dict(seq_lens=[5, 40, 33], heads=(4, 2), d=16, num_splits=3, sliding_window=7, softcap=3.0),
    dict(seq_lens=[23, 2], heads=(8, 1), d=24, sliding_window=20),  # MQA, D not a power of 2
    # A graph-like bound: 7 splits of 16 keys planned, 0 to 3 of them hold keys.
    dict(seq_lens=[1, 17, 40, 33], heads=(4, 2), d=16, num_splits=7, bound=70),
]
PREFILL_SEQS = [(0, 20), (16, 1), (9, 7), (30, 18)]
PREFILL_CPU = [
    dict(seqs=PREFILL_SEQS, heads=(4, 2), d=16),
    dict(seqs=PREFILL_SEQS, heads=(4, 2), d=16, sliding_window=7, softcap=3.0),
    dict(seqs=[(3, 5), (0, 1)], heads=(2, 2), d=24, dtype=torch.float16),
]


def run_cpu_cases(kind: str) -> None:
    """Entry point of the interpreter subprocess."""
    if kind == "decode":  # one interpreter start-up for the small kernels too
        check_write_kv()
        check_merge()
    for case in {"decode": DECODE_CPU, "prefill": PREFILL_CPU}.get(kind, []):
        (check_decode if kind == "decode" else check_prefill)(**case)


# ----- CPU: the interpreter ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_kernels_interpreted_on_cpu(kind):
    code = f"from tests.kernels.test_paged_attention import run_cpu_cases; run_cpu_cases({kind!r})"
    run_interpreted(code)


def test_references_agree_with_each_other():
    """A decode is a one-token prefill; the merge of one split is that split."""
    p = make_paged([7, 30], 4, 2, 8)
    q = torch.randn(2, 4, 8)
    qsl = torch.tensor([0, 1, 2])
    cache = (p.k_cache, p.v_cache, p.block_tables)
    for opts in OPTS:
        torch.testing.assert_close(
            ref.decode_attention_ref(q, *cache, p.seq_lens, 0.3, **opts),
            ref.prefill_attention_ref(q, *cache, qsl, p.seq_lens, 0.3, **opts),
        )
    part = torch.randn(2, 3, 1, 5)
    merged = ref.merge_attention_partials_ref(part, torch.zeros(2, 3, 1))
    torch.testing.assert_close(merged, part[:, :, 0])


def test_split_plan():
    from cvllm.kernels.paged_attention import plan_decode_splits

    assert plan_decode_splits(64, 8, 4096, 64, 132) == (1, 4096)  # enough programs already
    splits, split_len = plan_decode_splits(1, 8, 4096, 64, 132)
    assert splits == 32 and split_len == 128  # about two waves over 132 SMs
    splits, split_len = plan_decode_splits(1, 1, 100_000, 64, 132)
    assert splits <= 64 and splits * split_len >= 100_000 and split_len % 64 == 0
    assert plan_decode_splits(1, 8, 1, 64, 132) == (1, 64)


def test_wrappers_reject_bad_inputs():
    from cvllm.kernels import paged_attention as pa

    p = make_paged([5, 9], 16, 2, 16)
    q = torch.randn(2, 4, 16)
    args = (p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.25)
    with pytest.raises(ValueError, match="multiple"):
        pa.decode_attention(torch.randn(2, 3, 16), *args)
    with pytest.raises(ValueError, match="dtype"):
        pa.decode_attention(q.double(), *args)
    with pytest.raises(ValueError, match="block_tables"):
        pa.decode_attention(q, p.k_cache, p.v_cache, p.block_tables[:1], p.seq_lens, 0.25)
    with pytest.raises(ValueError, match="unit stride"):
        pa.decode_attention(torch.randn(2, 16, 4).transpose(1, 2), *args)
    with pytest.raises(ValueError, match="out"):
        pa.decode_attention(q, *args, out=torch.empty(2, 4, 8))
    with pytest.raises(ValueError, match="query_start_loc"):
        pa.prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, torch.tensor([0, 1]),
                             p.seq_lens, 1, 0.25)
    with pytest.raises(ValueError, match="slot_mapping"):
        pa.write_kv(q[:, :2], q[:, :2], p.k_cache, p.v_cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="k_cache"):
        pa.write_kv(q[:, :2], q[:, :2], p.k_cache, p.v_cache[:1], torch.tensor([0, 1]))


# ----- GPU: compiled, model-sized ---------------------------------------------------------------

# bf16 for every head shape (Llama-3 8B, MHA, Gemma-style MQA 256, a non-power-of-2 dim);
# fp16 and fp32 for the 8B shape. Kept lean: each combination compiles its own kernels.
GPU_CONFIGS = [(torch.bfloat16, (32, 8), 128), (torch.bfloat16, (16, 16), 64),
               (torch.bfloat16, (8, 1), 256), (torch.bfloat16, (12, 4), 80),
               (torch.float16, (32, 8), 128), (torch.float32, (32, 8), 128)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,heads,d", GPU_CONFIGS)
@pytest.mark.parametrize("opts", OPTS + [{"sliding_window": 1000}])
@pytest.mark.parametrize("seq_lens,num_splits,bound", [
    ([1, 17, 300, 4000, 2049, 64, 1500], None, 0),  # 7 x Hkv programs: the planner splits
    ([5000], None, 0),
    ([3000, 1], 1, 0),  # long and unsplit
    ([700, 33, 2100], 7, 0),
    ([130], None, 2000),  # batch 1 in a graph planned for 2130 keys: 3 of 34 splits hold keys
    ([1, 64, 65, 900], None, 3000),
])
def test_decode_cuda(dtype, heads, d, opts, seq_lens, num_splits, bound):
    check_decode(seq_lens, heads, d, device="cuda", dtype=dtype, num_splits=num_splits,
                 bound=bound, **opts)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,heads,d", GPU_CONFIGS)
@pytest.mark.parametrize("opts", OPTS + [{"sliding_window": 100}])
@pytest.mark.parametrize("seqs", [
    [(0, 300), (1000, 129), (17, 1), (64, 64), (0, 5), (3, 1)],  # prefills, chunks, 1-row tails
    [(0, 1024)],
    [(2000, 512), (0, 1)],
])
def test_prefill_cuda(dtype, heads, d, opts, seqs):
    check_prefill(seqs, heads, d, device="cuda", dtype=dtype, **opts)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("bs", [1, 8, 32])
def test_other_block_sizes_cuda(bs):
    seqs = [(0, 300), (1000, 129), (17, 1), (5, 40)]
    check_prefill(seqs, (32, 8), 128, bs=bs, device="cuda", dtype=torch.bfloat16, softcap=30.0)
    check_decode([1, 33, 1000, 4000], (32, 8), 128, bs=bs, device="cuda", dtype=torch.bfloat16,
                 sliding_window=512)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,hkv,d", [(1, 8, 128), (4097, 8, 128), (300, 32, 80), (64, 1, 256)])
def test_write_kv_cuda(dtype, T, hkv, d):
    check_write_kv("cuda", dtype, T=T, hkv=hkv, d=d)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_merge_cuda():
    check_merge("cuda", B=33, H=32, S=64, D=128)


def test_per_step_arguments_pick_no_new_kernel_variant():
    """What follows the batch (a block table's width, split counts, metadata sliced past
    the decodes) is not specialized on, and the merge kernel has two split tiles: a mixed
    step never waits for a compile (tests/engine/test_warm_up_gpu.py on the GPU)."""
    from cvllm.kernels.paged_attention import decode as pd
    from cvllm.kernels.paged_attention import prefill as pp

    ints = {pp._prefill_kernel: ("stride_bt",),
            pd._decode_kernel: ("split_len", "num_splits", "stride_bt"),
            pd._merge_kernel: ("num_splits",)}
    pointers = {pp._prefill_kernel: ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"),
                pd._decode_kernel: ("block_tables_ptr", "seq_lens_ptr", "ticket_ptr"),
                pd._merge_kernel: ()}
    for kernel in ints:
        params = {p.name: p for p in getattr(kernel, "params", [])}
        if not params:
            pytest.skip("this Triton's kernels do not expose their parameters")
        for name in ints[kernel]:
            assert params[name].do_not_specialize, (kernel.fn.__name__, name)
        for name in pointers[kernel]:  # older Triton: do_not_specialize covers alignment
            p = params[name]
            assert getattr(p, "do_not_specialize_on_alignment", p.do_not_specialize), \
                (kernel.fn.__name__, name)
    assert {pd.merge_block_s(s) for s in range(1, pd._MAX_SPLITS + 1)} == {16, 64}
