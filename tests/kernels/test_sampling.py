"""The GPU sampling kernels against their torch references, the references against the
torch sampler (``layers/sampler.py``, the semantic reference), and the in-kernel Philox
noise against the distribution it must draw from.

With the same Exp(1) noise, kernel and reference pick the same token in every row: the
race's winner only moves when two scores tie to float rounding. The unsorted path, the
``topk``-ranked path and the fully sorted path are each compared. On the CPU the kernels
run under Triton's interpreter (``TRITON_INTERPRET=1``, in a fresh subprocess) with small
vocabularies; the ``gpu`` tests use a 151936-token vocabulary and the real Sampler.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from cvllm.kernels.reference import sampling as ref
from cvllm.kernels.sampling import _exp_noise
from cvllm.layers.sampler import Sampler
from cvllm.layers.sampling_tensors import SamplingTensors
from tests.interpreted import run_interpreted

CUDA = torch.cuda.is_available()


def make_rows(S, V, seed=0, device="cpu", top_k=True, top_p=True, greedy=True):
    """Mixed per-row settings: temperatures, top-k (V = off), top-p, min-p, greedy rows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, V, generator=g) * 3  # [S, V]
    temperature = torch.rand(S, generator=g) * 1.5 + 0.3
    ks = torch.randint(1, max(2, V // 4), (S,), generator=g)
    top_k_t = torch.where(torch.rand(S, generator=g) < 0.5, ks, V) if top_k else torch.full((S,), V)
    top_p_t = torch.where(torch.rand(S, generator=g) < 0.5, torch.rand(S, generator=g), 1.0) \
        if top_p else torch.ones(S)
    min_p = torch.where(torch.rand(S, generator=g) < 0.3, torch.rand(S, generator=g) * 0.2, 0.0)
    is_greedy = (torch.rand(S, generator=g) < 0.2) if greedy else torch.zeros(S, dtype=torch.bool)
    noise = torch.empty(S, V).exponential_(generator=g)  # [S, V]
    seeds = torch.randint(0, 1 << 62, (S,), generator=g)
    rows = dict(temperature=temperature, top_k=top_k_t.long(), top_p=top_p_t.float(),
                min_p=min_p.float(), is_greedy=is_greedy, seeds=seeds)
    to = lambda t: t.to(device)  # noqa: E731
    return to(logits), {k: to(v) for k, v in rows.items()}, to(noise)


def width_of(rows, V):
    """The host-side plan the Sampler computes: largest top-k of the sampled rows."""
    sampled = ~rows["is_greedy"]
    if not sampled.any():
        return V
    return int(rows["top_k"][sampled].max())


def check_sample(S=12, V=300, device="cpu", seed=0, mode="sorted"):
    """``mode``: race (no top-k/top-p), topk (every sampled row has a top-k), sorted."""
    from cvllm.kernels.sampling import sample

    logits, rows, noise = make_rows(S, V, seed, device, top_k=mode != "race",
                                    top_p=mode == "sorted")
    if mode == "topk":
        rows["top_k"] = torch.randint(1, 20, (S,), generator=torch.Generator().manual_seed(seed))
        rows["top_k"] = rows["top_k"].to(device)
    want = ref.sample_ref(logits, noise=noise, **{k: v for k, v in rows.items() if k != "seeds"})
    width = None if mode == "race" else width_of(rows, V)
    assert mode != "topk" or width < V
    got = sample(logits, **rows, truncate_width=width, do_top_p=mode == "sorted", noise=noise)
    assert got.dtype == torch.int64 and got.shape == (S,)
    assert torch.equal(got.cpu(), want.cpu()), (got, want)


def check_penalties(S=5, V=700, device="cpu"):
    from cvllm.kernels.sampling import apply_penalties

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(S, V, generator=g) * 3).to(device)
    counts_full = torch.randint(0, 3, (S, V + 1), generator=g, dtype=torch.int32).to(device)
    counts = counts_full[:, :V]  # strided, like the sampler's
    prompt = (torch.rand(S, V, generator=g) < 0.2).to(device)
    rp = (torch.rand(S, generator=g) + 0.5).to(device)
    fp, pp = torch.rand(S, generator=g).to(device), torch.rand(S, generator=g).to(device)
    for args in ((prompt, rp, fp, pp), (prompt, rp, None, None), (None, None, fp, pp)):
        got = apply_penalties(logits, counts, *args)
        want = ref.apply_penalties_ref(logits, counts, *args)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@triton.jit
def _noise_probe_kernel(seed_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """Row ``pid0``: the noise of tokens ``pid1 * BLOCK ..`` under key ``seeds[pid0]``."""
    row = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    noise = _exp_noise(tl.load(seed_ptr + row), ids, out_ptr, False)
    tl.store(out_ptr + row * N + ids, noise, mask=ids < N)


def check_noise_is_exponential(device="cpu", n=1 << 15):
    """The Philox draw is Exp(1) (Kolmogorov-Smirnov), never 0, and two keys' streams are
    uncorrelated."""
    keys = torch.tensor([12345, 12346], device=device)
    noise = torch.empty(2, n, device=device)
    _noise_probe_kernel[(2, triton.cdiv(n, 1024))](keys, noise, n, BLOCK=1024)
    noise = noise.cpu().double()
    assert noise.min() > 0 and torch.isfinite(noise).all()
    sorted_noise = noise[0].sort().values
    cdf = 1 - torch.exp(-sorted_noise)
    ks = (cdf - torch.arange(1, n + 1).double() / n).abs().max()
    assert ks < 1.95 / n**0.5, ks  # 0.1% level
    assert abs(torch.corrcoef(noise)[0, 1]) < 4 / n**0.5


def check_philox_race(device="cpu", n=200, tol=0.12):
    """Unsorted and sorted races draw from the (truncated) softmax, and a keyed row's
    token depends only on its key and its logits."""
    from cvllm.kernels.sampling import sample

    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])  # [1, 6]
    logits = base.repeat(n, 1).to(device)
    g = torch.Generator().manual_seed(7)
    keys = torch.randperm(1 << 20, generator=g)[:n].to(device)  # distinct: independent rows
    ones = dict(temperature=torch.ones(n), top_p=torch.ones(n), min_p=torch.zeros(n),
                is_greedy=torch.zeros(n, dtype=torch.bool))
    ones = {k: v.to(device) for k, v in ones.items()}
    for k, width in ((6, None), (3, 3)):
        top_k = torch.full((n,), k, dtype=torch.int64, device=device)
        got = sample(logits, top_k=top_k, seeds=keys, truncate_width=width, do_top_p=False, **ones)
        freq = torch.bincount(got.cpu(), minlength=6).float() / n
        kept = base[0].topk(k).indices
        want = torch.zeros(6)
        want[kept] = base[0, kept].softmax(-1)
        assert (freq - want).abs().max() < tol, (k, freq, want)
    # Row 0 alone and inside a batch of others: same key, same token, on both paths.
    mixed = torch.cat([torch.randn(4, 6, generator=g).to(device), logits[:1]])  # [5, 6]
    for width in (None, 6):
        alone = sample(logits[:1], top_k=top_k[:1], seeds=keys[:1], truncate_width=width,
                       **{k: v[:1] for k, v in ones.items()})
        batch = sample(mixed, top_k=top_k[:5], seeds=torch.cat([keys[1:5], keys[:1]]),
                       truncate_width=width, **{k: v[:5] for k, v in ones.items()})
        assert batch[4] == alone[0]


def check_sampler_plumbing(device="cpu"):
    """Sampler's GPU path (called directly, so it also runs on the CPU interpreter):
    greedy and top_k=1 rows are the penalized argmax, seeded rows repeat."""
    S, V = 6, 40
    logits = (torch.randn(S, V) * 2).to(device)
    t = SamplingTensors.from_lists(
        temperature=[0.0, 0.8, 1.0, 0.0, 1.3, 0.7], top_p=[1.0, 0.9, 1.0, 1.0, 0.5, 1.0],
        top_k=[-1, 1, 5, -1, -1, 1], min_p=[0.0, 0.0, 0.1, 0.0, 0.0, 0.0],
        presence_penalty=[0.0, 0.5, 0.0, 1.0, 0.0, 0.0], frequency_penalty=[0.0] * S,
        repetition_penalty=[1.0, 1.0, 1.2, 1.0, 1.0, 1.0], seeds=[None, 3, 4, None, 5, None],
        output_index=[0, 1, 2, 3, 4, 5], prompt_token_ids=[[1, 2]] * S,
        output_token_ids=[[3, 3]] * S, vocab_size=V, device=device)
    assert t.max_top_k == V  # row 4 has top-p without top-k: a full sort
    penalized = ref.apply_penalties_ref(
        logits, t.output_counts, t.prompt_mask, t.repetition_penalty, t.frequency_penalty,
        t.presence_penalty)
    first = Sampler()._sample_on_gpu(logits, t)
    for row in (0, 1, 3, 5):
        assert first[row] == penalized[row].argmax()
    again = Sampler()._sample_on_gpu(logits, t)
    assert torch.equal(first[[1, 2, 4]], again[[1, 2, 4]])
    assert first[2] in penalized[2].topk(5).indices


def check_row_stats(S=5, V=9000, device="cpu", seed=0):
    """Max, first argmax and logsumexp equal torch's: ties across slices and within one,
    a row whose max is in the last (ragged) slice, a row with -inf entries and a row of
    only -inf."""
    from cvllm.kernels.sampling import STATS_BLOCK, row_stats

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, V, generator=g) * 4
    x[0, 3] = x[0, STATS_BLOCK + 5] = 50.0  # tie across slices: the first wins
    if S > 3:
        x[1, V - 1] = 60.0  # in the ragged last slice
        x[2, 10:4000] = float("-inf")
        x[3] = float("-inf")
    if S > 4:
        x[4, 7] = float("inf")  # logsumexp +inf, argmax at the +inf
    x = x.to(device)
    m, arg, lse = row_stats(x)
    want_m, want_arg = x.max(dim=-1)
    assert torch.equal(m.cpu(), want_m.cpu()) and torch.equal(arg.cpu(), want_arg.cpu())
    assert arg.dtype == torch.int64
    torch.testing.assert_close(lse.cpu(), x.logsumexp(dim=-1).cpu(), atol=1e-5, rtol=1e-6)
    if S > 3:
        assert lse[3].item() == float("-inf") and arg[3].item() == 0
    # Written into given outputs (a CUDA graph's static buffers): the same values.
    out = (torch.zeros(S, device=device), torch.zeros(S, dtype=torch.int64, device=device),
           torch.zeros(S, device=device))
    assert all(o is r for o, r in zip(row_stats(x, out=out), out))
    assert all(torch.equal(o, r) for o, r in zip(out, (m, arg, lse)))
    with pytest.raises(ValueError, match="outputs must be"):
        row_stats(x, out=(out[0], out[1].int(), out[2]))


CPU_SAMPLE = [dict(mode="race", V=5000, S=6), dict(mode="race", seed=1),
              dict(mode="topk", seed=2), dict(mode="sorted", seed=3),
              dict(mode="sorted", V=2500, S=4, seed=4)]


def run_cpu_cases() -> None:
    """Entry point of the interpreter subprocess."""
    for case in CPU_SAMPLE:
        check_sample(**case)
    check_penalties()
    check_row_stats()
    check_noise_is_exponential()
    check_philox_race()
    check_sampler_plumbing()


def test_kernels_interpreted_on_cpu():
    code = "from tests.kernels.test_sampling import run_cpu_cases; run_cpu_cases()"
    run_interpreted(code)


def _tensors_from_rows(rows, V):
    """The same rows as a SamplingTensors (greedy rows at temperature 0)."""
    temps = [0.0 if g else float(t) for g, t in zip(rows["is_greedy"], rows["temperature"])]
    S = len(temps)
    return SamplingTensors.from_lists(
        temperature=temps, top_p=rows["top_p"].tolist(), top_k=rows["top_k"].tolist(),
        min_p=rows["min_p"].tolist(), presence_penalty=[0.0] * S, frequency_penalty=[0.0] * S,
        repetition_penalty=[1.0] * S, seeds=[None] * S, output_index=[0] * S,
        prompt_token_ids=[()] * S, output_token_ids=[()] * S, vocab_size=V, device="cpu")


@pytest.mark.parametrize("seed", range(4))
def test_sample_ref_is_the_torch_sampler(seed, monkeypatch):
    """sample_ref with the sampler's own noise picks the sampler's tokens (CPU)."""
    V = 200
    logits, rows, noise = make_rows(16, V, seed)
    monkeypatch.setattr(Sampler, "_exponential_noise", lambda self, probs, t: noise.clone())
    got = Sampler()(logits, _tensors_from_rows(rows, V)).sampled
    want = ref.sample_ref(logits, noise=noise, **{k: v for k, v in rows.items() if k != "seeds"})
    assert torch.equal(got, want)


def test_penalties_ref_is_the_torch_sampler():
    from cvllm.layers.sampler import apply_penalties

    S, V = 3, 9
    t = SamplingTensors.from_lists(
        temperature=[1.0] * S, top_p=[1.0] * S, top_k=[-1] * S, min_p=[0.0] * S,
        presence_penalty=[0.3, 0.0, 1.0], frequency_penalty=[0.2, 0.0, 0.5],
        repetition_penalty=[1.3, 2.0, 1.0], seeds=[None] * S, output_index=[0] * S,
        prompt_token_ids=[[1, 2], [0], [5]], output_token_ids=[[2, 2, 7], [], [8]],
        vocab_size=V, device="cpu")
    logits = torch.randn(S, V) * 3
    want = apply_penalties(logits, t)
    got = ref.apply_penalties_ref(logits, t.output_counts, t.prompt_mask, t.repetition_penalty,
                                  t.frequency_penalty, t.presence_penalty)
    assert torch.equal(got, want)


def test_wrappers_reject_bad_inputs():
    from cvllm.kernels.sampling import apply_penalties, sample

    logits, rows, noise = make_rows(3, 10)
    with pytest.raises(ValueError, match="float32"):
        sample(logits.double(), **rows)
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, **{**rows, "top_k": rows["top_k"][:2]})
    with pytest.raises(ValueError, match="seeds must be"):
        sample(logits, **{**rows, "seeds": rows["seeds"].int()})
    with pytest.raises(ValueError, match="truncate_width"):
        sample(logits, **rows, truncate_width=11)
    with pytest.raises(ValueError, match="noise"):
        sample(logits, **rows, noise=noise[:, :5])
    with pytest.raises(ValueError, match="output_counts"):
        apply_penalties(logits, torch.zeros(3, 9, dtype=torch.int32), None, None, None, None)


# ----- GPU: compiled, real vocabulary ---------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["race", "topk", "sorted"])
@pytest.mark.parametrize("S", [1, 64])
def test_sample_cuda(mode, S):
    check_sample(S, 151936, "cuda", seed=S, mode=mode)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("S,V", [(1, 128256), (7, 151936), (64, 32000)])
def test_row_stats_cuda(S, V):
    check_row_stats(S, V, "cuda", seed=S)


@pytest.mark.gpu
@gpu
def test_penalties_cuda():
    check_penalties(64, 151936, "cuda")


@pytest.mark.gpu
@gpu
def test_philox_noise_cuda():
    check_noise_is_exponential("cuda", n=1 << 20)
    check_philox_race("cuda", n=20000, tol=0.015)


@pytest.mark.gpu
@gpu
def test_sampler_plumbing_cuda():
    check_sampler_plumbing("cuda")


@pytest.mark.gpu
@gpu
def test_sampler_on_cuda_draws_top_k_top_p_distribution():
    """The whole CUDA Sampler (penalties, temperature, top-k, top-p) against the
    distribution the torch formulas give."""
    n, V = 20000, 1000
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, V, generator=g) * 2
    logits = row.repeat(n, 1).cuda()
    t = SamplingTensors.from_lists(
        temperature=[0.8] * n, top_p=[0.9] * n, top_k=[8] * n, min_p=[0.0] * n,
        presence_penalty=[0.5] * n, frequency_penalty=[0.0] * n, repetition_penalty=[1.0] * n,
        seeds=[None] * n, output_index=[0] * n, prompt_token_ids=[()] * n,
        output_token_ids=[[int(row.argmax())]] * n, vocab_size=V, device="cuda")
    got = Sampler()(logits, t).sampled.cpu()
    penalized = row.clone()
    penalized[0, row.argmax()] -= 0.5
    scaled = penalized[0] / 0.8
    vals, ids = scaled.topk(8)
    probs = vals.softmax(-1)
    keep = (probs.cumsum(-1) - probs) < 0.9
    want = torch.zeros(V)
    want[ids[keep]] = vals[keep].softmax(-1)
    freq = torch.bincount(got, minlength=V).float() / n
    assert (freq - want).abs().max() < 0.02
