"""The sampling step on the GPU, with no host synchronisation (Triton + torch ops).

Called by ``layers/sampler.Sampler`` on CUDA logits (rank 0); the oracles are
``kernels/reference/sampling.apply_penalties_ref`` and ``sample_ref``, which transcribe
the torch sampler's semantics (tests/kernels/test_sampling.py, also run on the CPU under
``TRITON_INTERPRET=1``). Nothing here keeps state; every output stays on the device.

What runs where, and why:

- ``apply_penalties`` (Triton, elementwise): repetition, frequency and presence
  penalties in one pass over ``[S, V]``, reading the count/mask tensors the sampler
  builds. A separate kernel because the sort below must see penalized logits; launched
  only when some row penalizes.
- ``row_stats`` (Triton, two kernels): each row's max, first argmax and log-sum-exp,
  from ``STATS_BLOCK`` slices of the vocabulary in parallel and then one combine per row.
  It gives the greedy tokens, the race's row max and the logprob normaliser; torch's own
  single-row reductions (``argmax``, ``logsumexp``) run one block per row and took 10x
  longer at batch 1 over a 128K vocabulary.
- No top-k/top-p in the batch (the common case): ``row_stats`` gives each row's max (and
  the greedy argmax), then ``_race_kernel`` (Triton) runs temperature, softmax, min-p and
  the exponential race for one ``BLOCK`` of the vocabulary per program, so the whole GPU
  works even on one row; a tiny torch argmax picks the best block. No ``[S, V]``
  temporaries (probs, noise) reach memory.
- Top-k/top-p: the rows are ordered by ``torch.topk`` (only the largest top-k of the
  batch, when every sampled row has one) or ``torch.sort``; ranking is what a GPU sort is
  good at and Triton is not. ``_sorted_race_kernel`` (Triton, one program per row) then
  applies temperature, top-k (a rank), top-p (a running cumsum), min-p and the race in
  sorted order. Sorting moves no data between host and device.

The race is the torch sampler's: ``argmax(p / E)``, ``E ~ Exp(1)`` per (row, token). The
softmax normaliser cancels in the argmax and min-p compares against the top token's
probability, so both work on ``e = exp(l / T - max(l / T))`` directly (the top token has
``e = 1``); the result is the same token up to float rounding. ``E`` comes from
Philox keyed by a per-row 64-bit seed and the token id (``noise`` can be passed instead,
for tests): a seeded row's draw depends on nothing else in the batch, as on the CPU,
though the stream differs from torch's generators. Greedy rows take the argmax of the
penalized logits (``torch.max``, first index on ties, like ``argmax``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

RACE_BLOCK = 2048
SORTED_BLOCK = 1024
STATS_BLOCK = 4096


@triton.jit
def _row_stats_part_kernel(
    x_ptr, part_max_ptr, part_arg_ptr, part_sum_ptr, V, stride_x, num_blocks,
    BLOCK: tl.constexpr,
):
    """Row ``pid0``, slice ``pid1``: the slice's max, its first argmax and
    ``sum exp(x - max)`` (0 for a slice with no finite value)."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    arg = tl.argmax(x, axis=0, tie_break_left=True)
    shift = tl.where(m > float("-inf"), m, 0.0)  # masked and -inf entries add exp(-inf) = 0
    total = tl.sum(tl.exp(x - shift), axis=0)
    out = row * num_blocks + blk
    tl.store(part_max_ptr + out, m)
    tl.store(part_arg_ptr + out, blk * BLOCK + arg)
    tl.store(part_sum_ptr + out, total)


@triton.jit
def _row_stats_combine_kernel(
    part_max_ptr, part_arg_ptr, part_sum_ptr, max_ptr, arg_ptr, lse_ptr, num_blocks,
    BLOCK_B: tl.constexpr,
):
    """Row ``pid``: max and first argmax over the slices (the first slice holding the
    max), and ``lse = max + log(sum_b sum_b' exp(max_b - max))``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_B)
    bmask = offs < num_blocks
    base = row * num_blocks
    m_b = tl.load(part_max_ptr + base + offs, mask=bmask, other=float("-inf"))
    s_b = tl.load(part_sum_ptr + base + offs, mask=bmask, other=0.0)
    m = tl.max(m_b, axis=0)
    first = tl.min(tl.where(bmask & (m_b == m), offs, num_blocks), axis=0)
    first = tl.minimum(first, num_blocks - 1)  # a row of -inf: slice 0, like torch
    arg = tl.load(part_arg_ptr + base + first)
    finite = m > float("-inf")
    w = tl.exp(m_b - tl.where(finite, m, 0.0))  # 0 for empty slices and padding
    lse = tl.where(finite, m + tl.log(tl.sum(s_b * w, axis=0)), float("-inf"))
    lse = tl.where(m == float("inf"), float("inf"), lse)  # torch: logsumexp of +inf is +inf
    tl.store(max_ptr + row, m)
    tl.store(arg_ptr + row, arg.to(tl.int64))
    tl.store(lse_ptr + row, lse)


def row_stats(logits: torch.Tensor, out: Optional[tuple] = None):
    """``logits [S, V]`` float32 -> ``(max [S] float32, argmax [S] int64, lse [S] float32)``:
    ``torch.max(dim=-1)`` (first index on ties) and ``torch.logsumexp(dim=-1)`` of finite
    or infinite logits (NaN is not handled: logits never hold it). ``out``: the three
    contiguous ``[S]`` tensors to write (a CUDA graph's static outputs)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [S, V]; got {tuple(logits.shape)}")
    _check_matrix("logits", logits, logits, (torch.float32,))
    num_rows, vocab = logits.shape
    dev = logits.device
    if out is None:
        row_max = torch.empty(num_rows, dtype=torch.float32, device=dev)
        arg = torch.empty(num_rows, dtype=torch.int64, device=dev)
        lse = torch.empty(num_rows, dtype=torch.float32, device=dev)
    else:
        row_max, arg, lse = out
        for t, dt in zip(out, (torch.float32, torch.int64, torch.float32)):
            if t.shape != (num_rows,) or t.dtype != dt or t.device != dev or not t.is_contiguous():
                raise ValueError(f"row_stats outputs must be contiguous [{num_rows}] "
                                 f"(float32, int64, float32) on {dev}")
    if num_rows == 0:
        return row_max, arg, lse
    if vocab == 0:
        raise ValueError("row_stats needs at least one column")
    nb = triton.cdiv(vocab, STATS_BLOCK)
    part_max = torch.empty(num_rows, nb, dtype=torch.float32, device=dev)
    part_arg = torch.empty(num_rows, nb, dtype=torch.int32, device=dev)
    part_sum = torch.empty(num_rows, nb, dtype=torch.float32, device=dev)
    _row_stats_part_kernel[(num_rows, nb)](
        logits, part_max, part_arg, part_sum, vocab, logits.stride(0), nb,
        BLOCK=STATS_BLOCK, num_warps=8,
    )
    _row_stats_combine_kernel[(num_rows,)](
        part_max, part_arg, part_sum, row_max, arg, lse, nb,
        BLOCK_B=max(2, triton.next_power_of_2(nb)), num_warps=1,
    )
    return row_max, arg, lse


@triton.jit
def _penalties_kernel(
    logits_ptr, out_ptr, counts_ptr, prompt_ptr, rep_ptr, freq_ptr, pres_ptr,
    V, stride_l, stride_o, stride_c, stride_p,
    DO_REP: tl.constexpr, DO_FREQ_PRES: tl.constexpr, BLOCK: tl.constexpr,
):
    """Row ``pid0``, columns ``pid1 * BLOCK ..``: repetition (divide positive, multiply
    negative logits of seen tokens), then ``- freq * count - pres * (count > 0)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    lg = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
    counts = tl.load(counts_ptr + row * stride_c + cols, mask=mask, other=0).to(tl.float32)
    if DO_REP:
        in_prompt = tl.load(prompt_ptr + row * stride_p + cols, mask=mask, other=0) != 0
        rp = tl.load(rep_ptr + row)
        penalized = tl.where(lg > 0, lg / rp, lg * rp)
        lg = tl.where(in_prompt | (counts > 0), penalized, lg)
    if DO_FREQ_PRES:
        fp = tl.load(freq_ptr + row)
        pp = tl.load(pres_ptr + row)
        lg = lg - fp * counts - pp * (counts > 0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, lg, mask=mask)


@triton.jit
def _exp_noise(seed, token_ids, noise_row_ptr, HAS_NOISE: tl.constexpr):
    """Exp(1) per token: ``-log(u)`` with ``u`` on a 2^-23 grid centred in (0, 1), so
    ``E`` is never 0 (a 0 would let any token win); or the given noise, floored like the
    torch sampler's."""
    if HAS_NOISE:
        e = tl.maximum(tl.load(noise_row_ptr + token_ids), 1.1754943508222875e-38)
    else:
        bits = tl.randint(seed, token_ids.to(tl.int32))  # uint32
        u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
        e = -tl.log(u)
    return e


@triton.jit
def _race_kernel(
    logits_ptr, row_max_ptr, temp_ptr, min_p_ptr, greedy_ptr, seed_ptr, noise_ptr,
    part_score_ptr, part_token_ptr,
    V, stride_l, stride_n, num_blocks,
    HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Row ``pid0``, vocabulary block ``pid1``: the block's best ``e / E`` over tokens with
    ``e >= min_p`` and its token id (score -1 when none; greedy rows skip)."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    out = row * num_blocks + blk
    if tl.load(greedy_ptr + row) != 0:
        tl.store(part_score_ptr + out, -1.0)
        tl.store(part_token_ptr + out, 0)
        return
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    lg = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf"))
    temp = tl.load(temp_ptr + row)
    top = tl.load(row_max_ptr + row) / temp
    e = tl.exp(lg / temp - top)  # [BLOCK]; p * Z
    noise = _exp_noise(tl.load(seed_ptr + row), cols, noise_ptr + row * stride_n, HAS_NOISE)
    keep = mask & (e >= tl.load(min_p_ptr + row))
    score = tl.where(keep, e / noise, -1.0)
    best = tl.argmax(score, axis=0)
    tl.store(part_score_ptr + out, tl.max(score, axis=0))
    tl.store(part_token_ptr + out, blk * BLOCK + best)


@triton.jit
def _sorted_race_kernel(
    vals_ptr, ids_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, greedy_ptr, seed_ptr,
    noise_ptr, out_ptr,
    W, stride_v, stride_i, stride_n,
    DO_TOP_P: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Row ``pid``, ``W`` penalized logits sorted descending with their token ids: keep
    rank < top_k, then (top_p < 1) tokens whose softmax mass before them is < top_p (the
    first always), then ``e >= min_p``; race the survivors. Greedy rows skip."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(greedy_ptr + row) != 0:
        return
    lanes = tl.arange(0, BLOCK)
    vals_row = vals_ptr + row * stride_v
    temp = tl.load(temp_ptr + row)
    top = tl.load(vals_row) / temp
    k = tl.minimum(tl.load(top_k_ptr + row), W)
    top_p = tl.load(top_p_ptr + row)
    top_p = tl.where(top_p < 1.0, top_p, float("inf"))  # rows at 1 keep their whole tail
    min_p = tl.load(min_p_ptr + row)
    seed = tl.load(seed_ptr + row)
    z = 1.0
    if DO_TOP_P:  # the softmax normaliser over the top-k survivors
        acc = tl.zeros([BLOCK], tl.float32)
        for j0 in range(0, W, BLOCK):
            ranked = (j0 + lanes) < k
            v = tl.load(vals_row + j0 + lanes, mask=ranked, other=float("-inf"))
            acc += tl.where(ranked, tl.exp(v / temp - top), 0.0)
        z = tl.sum(acc, axis=0)
    carry = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_tok = tl.zeros([BLOCK], tl.int64)
    for j0 in range(0, W, BLOCK):
        rank = j0 + lanes
        ranked = rank < k
        v = tl.load(vals_row + rank, mask=ranked, other=float("-inf"))
        e = tl.where(ranked, tl.exp(v / temp - top), 0.0)
        keep = ranked & (e >= min_p)
        if DO_TOP_P:
            cum = tl.cumsum(e, axis=0) + carry
            mass_before = (cum - e) / z
            keep = keep & ((mass_before < top_p) | (rank == 0))
            carry = tl.max(cum, axis=0)
        tok = tl.load(ids_ptr + row * stride_i + rank, mask=ranked, other=0).to(tl.int64)
        noise = _exp_noise(seed, tok, noise_ptr + row * stride_n, HAS_NOISE)
        score = tl.where(keep, e / noise, -1.0)
        better = score > best
        best = tl.where(better, score, best)
        best_tok = tl.where(better, tok, best_tok)
    lane = tl.argmax(best, axis=0)
    tl.store(out_ptr + row, tl.sum(tl.where(lanes == lane, best_tok, 0), axis=0))


def _check_rows(logits: torch.Tensor, **rows: Optional[torch.Tensor]) -> None:
    """``logits [S, V]`` float32 with unit stride along V; each per-row tensor ``[S]`` on
    its device. Raises ValueError."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [S, V] float32 with unit stride; got "
                         f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    for name, t in rows.items():
        if t is None:
            continue
        if t.shape != (logits.shape[0],) or t.device != logits.device:
            raise ValueError(f"{name} must be [S={logits.shape[0]}] on {logits.device}; got "
                             f"{tuple(t.shape)} on {t.device}")


def _check_matrix(name: str, t: torch.Tensor, logits: torch.Tensor, dtypes) -> None:
    if t.shape != logits.shape or t.dtype not in dtypes or t.stride(1) != 1:
        raise ValueError(f"{name} must be {tuple(logits.shape)} {dtypes} with unit stride; got "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if t.device != logits.device:
        raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: Optional[torch.Tensor],
    repetition_penalty: Optional[torch.Tensor],
    frequency_penalty: Optional[torch.Tensor],
    presence_penalty: Optional[torch.Tensor],
) -> torch.Tensor:
    """Penalized copy of ``logits [S, V]`` float32; the contract of
    ``reference.apply_penalties_ref``. ``output_counts [S, V]`` int; the repetition penalty
    runs when ``prompt_mask [S, V]`` bool and ``repetition_penalty [S]`` are given, the
    OpenAI ones when ``frequency_penalty`` and ``presence_penalty [S]`` are."""
    do_rep = prompt_mask is not None and repetition_penalty is not None
    do_fp = frequency_penalty is not None and presence_penalty is not None
    _check_rows(logits, repetition_penalty=repetition_penalty,
                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
    _check_matrix("output_counts", output_counts, logits, (torch.int32, torch.int64))
    if prompt_mask is not None:
        _check_matrix("prompt_mask", prompt_mask, logits, (torch.bool,))
    for t in (repetition_penalty, frequency_penalty, presence_penalty):
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"penalties must be float32; got {t.dtype}")
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)  # [S, V]
    num_rows, vocab = logits.shape
    if out.numel() == 0:
        return out
    prompt = prompt_mask.view(torch.uint8) if do_rep else output_counts
    dummy = logits  # never read: its stage is compiled out
    _penalties_kernel[(num_rows, triton.cdiv(vocab, RACE_BLOCK))](
        logits, out, output_counts, prompt,
        repetition_penalty if do_rep else dummy,
        frequency_penalty if do_fp else dummy, presence_penalty if do_fp else dummy,
        vocab, logits.stride(0), out.stride(0), output_counts.stride(0), prompt.stride(0),
        DO_REP=do_rep, DO_FREQ_PRES=do_fp, BLOCK=RACE_BLOCK, num_warps=8,
    )
    return out


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    is_greedy: torch.Tensor,
    seeds: torch.Tensor,
    truncate_width: Optional[int] = None,
    do_top_p: bool = True,
    noise: Optional[torch.Tensor] = None,
    row_max_argmax: Optional[tuple] = None,
) -> torch.Tensor:
    """One token per row of the (penalized) ``logits [S, V]`` float32 -> ``[S]`` int64; the
    contract of ``reference.sample_ref``. Per-row ``[S]`` tensors: ``temperature`` float32
    (> 0; greedy rows' is ignored), ``top_k`` int64 (V = off), ``top_p``, ``min_p``
    float32, ``is_greedy`` bool, ``seeds`` int64 (the Philox key of the row's noise).

    Host-side plan, known without a sync: ``truncate_width`` None when no sampled row
    uses top-k or top-p; otherwise how many of each row's largest logits can survive
    (the largest top-k of the sampled rows, or V). ``do_top_p``: some row has top_p < 1.
    ``noise [S, V]`` float32 replaces the Philox draw (tests). ``row_max_argmax``: the
    first two outputs of ``row_stats(logits)`` when the caller already has them."""
    _check_rows(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                is_greedy=is_greedy, seeds=seeds)
    want = {"temperature": (temperature, torch.float32), "top_k": (top_k, torch.int64),
            "top_p": (top_p, torch.float32), "min_p": (min_p, torch.float32),
            "is_greedy": (is_greedy, torch.bool), "seeds": (seeds, torch.int64)}
    for name, (t, dtype) in want.items():
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}; got {t.dtype}")
    if noise is not None:
        _check_matrix("noise", noise, logits, (torch.float32,))
    num_rows, vocab = logits.shape
    if num_rows == 0 or vocab == 0:
        return torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
    if truncate_width is not None and not 0 < truncate_width <= vocab:
        raise ValueError(f"truncate_width must be in 1..{vocab}; got {truncate_width}")
    row_max, greedy_tokens = row_max_argmax or row_stats(logits)[:2]  # [S], [S]; first on ties
    greedy = is_greedy.view(torch.uint8)
    noise_arg = noise if noise is not None else logits
    if truncate_width is None:
        return _race(logits, row_max, temperature, min_p, greedy, seeds, noise_arg,
                     noise is not None, greedy_tokens)
    if truncate_width < vocab:
        vals, ids = logits.topk(truncate_width, dim=-1)  # [S, W] descending
    else:
        vals, ids = logits.sort(dim=-1, descending=True)  # [S, V]
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    _sorted_race_kernel[(num_rows,)](
        vals, ids, temperature, top_k, top_p, min_p, greedy, seeds, noise_arg, out,
        vals.shape[1], vals.stride(0), ids.stride(0), noise_arg.stride(0),
        DO_TOP_P=do_top_p, HAS_NOISE=noise is not None, BLOCK=SORTED_BLOCK, num_warps=4,
    )
    return torch.where(is_greedy, greedy_tokens, out)


def _race(logits, row_max, temperature, min_p, greedy, seeds, noise, has_noise,
          greedy_tokens) -> torch.Tensor:
    """Unsorted race over ``RACE_BLOCK`` slices of each row, then the best slice."""
    num_rows, vocab = logits.shape
    num_blocks = triton.cdiv(vocab, RACE_BLOCK)
    part_score = torch.empty(num_rows, num_blocks, dtype=torch.float32, device=logits.device)
    part_token = torch.empty(num_rows, num_blocks, dtype=torch.int32, device=logits.device)
    _race_kernel[(num_rows, num_blocks)](
        logits, row_max, temperature, min_p, greedy, seeds, noise, part_score, part_token,
        vocab, logits.stride(0), noise.stride(0), num_blocks,
        HAS_NOISE=has_noise, BLOCK=RACE_BLOCK, num_warps=8,
    )
    best = part_score.argmax(dim=1, keepdim=True)  # [S, 1]
    race = part_token.gather(1, best)[:, 0].to(torch.int64)  # [S]
    return torch.where(greedy.bool(), greedy_tokens, race)
