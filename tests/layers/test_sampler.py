"""Sampler: greedy, truncation, seeded reproducibility, distribution, penalties, logprobs."""

import math

import pytest
import torch

from cvllm.layers.sampler import Sampler, _argmax_rows, apply_penalties
from cvllm.layers.sampling_tensors import SamplingTensors

V = 16
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] * torch.cuda.is_available()


def make_tensors(n, vocab=V, device="cpu", **kw):
    """SamplingTensors for n rows; any keyword is a per-row list or a scalar for all rows."""
    defaults = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0,
                    frequency_penalty=0.0, repetition_penalty=1.0, seeds=None, output_index=0,
                    prompt_token_ids=(), output_token_ids=())
    defaults.update(kw)
    cols = {k: (v if isinstance(v, list) else [v] * n) for k, v in defaults.items()}
    return SamplingTensors.from_lists(**cols, vocab_size=vocab, device=device)


def random_logits(rows, vocab=V, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 2.0).to(device)  # [S, V]


def test_greedy_is_argmax():
    logits = random_logits(5)
    out = Sampler()(logits, make_tensors(5, temperature=0.0))
    assert torch.equal(out.sampled, logits.argmax(-1))
    assert out.sampled.dtype == torch.int64


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_greedy_and_random_rows(device):
    logits = random_logits(4, device=device)
    t = make_tensors(4, temperature=[0.0, 1.0, 0.0, 1.0], top_k=[-1, 1, -1, 1], device=device)
    out = Sampler()(logits, t)
    assert torch.equal(out.sampled, logits.argmax(-1))


def test_top_k_1_is_argmax_at_temperature_1():
    logits = random_logits(8)
    for _ in range(20):
        out = Sampler()(logits, make_tensors(8, top_k=1))
        assert torch.equal(out.sampled, logits.argmax(-1))


def test_tiny_top_p_keeps_only_top_token():
    logits = random_logits(8)
    for _ in range(20):
        out = Sampler()(logits, make_tensors(8, top_p=1e-6))
        assert torch.equal(out.sampled, logits.argmax(-1))


def test_min_p_1_keeps_only_max():
    logits = random_logits(8)
    for _ in range(20):
        out = Sampler()(logits, make_tensors(8, min_p=1.0))
        assert torch.equal(out.sampled, logits.argmax(-1))


def test_top_p_keeps_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.2: top_p=0.7 keeps {0, 1} (0.5 < 0.7, 0.8 >= 0.7).
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(2000, 1)
    out = Sampler()(logits, make_tensors(2000, vocab=3, top_p=0.7))
    counts = torch.bincount(out.sampled, minlength=3).float() / 2000
    assert counts[2] == 0
    assert abs(counts[0] - 0.625) < 0.05


def test_top_k_restricts_support():
    logits = random_logits(1).repeat(3000, 1)
    out = Sampler()(logits, make_tensors(3000, top_k=3))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(out.sampled.tolist()) == allowed


@pytest.mark.parametrize("device", DEVICES)
def test_seed_is_independent_of_batch_composition_and_position(device):
    row = random_logits(1, seed=7, device=device)  # [1, V]
    others = random_logits(5, seed=8, device=device)
    t = make_tensors(1, seeds=[1234], output_index=[3], device=device)
    alone = Sampler()(row, t).sampled[0]
    for pos in range(6):
        batch = torch.cat([others[:pos], row, others[pos:]])  # [6, V]
        seeds = [None] * 6
        seeds[pos] = 1234
        idx = [0] * 6
        idx[pos] = 3
        torch.manual_seed(pos)  # the global stream changes; the seeded row must not
        out = Sampler()(batch, make_tensors(6, seeds=seeds, output_index=idx, device=device))
        assert out.sampled[pos] == alone


def test_seeded_rows_repeat_and_different_seeds_differ():
    logits = random_logits(1).repeat(400, 1)  # same distribution on every row
    t = make_tensors(400, seeds=list(range(400)), output_index=0)
    a = Sampler()(logits, t).sampled
    b = Sampler()(logits, t).sampled
    assert torch.equal(a, b)
    # 400 distinct seeds draw a spread of tokens, not one fixed choice.
    assert len(set(a.tolist())) > 3
    # The same seed at another output_index draws a different stream.
    c = Sampler()(logits, make_tensors(400, seeds=list(range(400)), output_index=1)).sampled
    assert not torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_empirical_distribution_matches_softmax(device):
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    n = 4000
    out = Sampler()(logits.repeat(n, 1).to(device), make_tensors(n, vocab=6, device=device))
    freq = torch.bincount(out.sampled.cpu(), minlength=6).float() / n
    assert (freq - logits.softmax(-1)[0]).abs().max() < 0.03


def test_temperature_sharpens_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0, -0.5]])
    n = 4000
    out = Sampler()(logits.repeat(n, 1), make_tensors(n, vocab=3, temperature=0.5))
    freq = torch.bincount(out.sampled, minlength=3).float() / n
    assert (freq - (logits / 0.5).softmax(-1)[0]).abs().max() < 0.03


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_formulas(device):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]], device=device)  # [1, 5]
    t = make_tensors(1, vocab=5, repetition_penalty=2.0, frequency_penalty=0.5,
                     presence_penalty=0.25, prompt_token_ids=[[0, 1]],
                     output_token_ids=[[1, 3, 3]], device=device)
    got = apply_penalties(logits, t).cpu()
    logits = logits.cpu()
    # repetition over prompt∪output {0, 1, 3}: 2/2, -1*2, 3/2; then output counts
    # token 1: 1, token 3: 2 -> subtract 0.5*count + 0.25.
    want = torch.tensor([[1.0, -2.0 - 0.75, 0.5, 1.5 - 1.25, -2.0]])
    assert torch.allclose(got, want)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]]))  # not in place


def test_penalty_rows_are_independent_and_skipped_when_unused():
    t = make_tensors(2, vocab=4, presence_penalty=[1.0, 0.0],
                     output_token_ids=[[2], [2]], prompt_token_ids=[[1], [1]])
    assert t.prompt_mask is None and not t.do_repetition
    got = apply_penalties(torch.zeros(2, 4), t)
    assert torch.equal(got, torch.tensor([[0.0, 0.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    plain = make_tensors(2, vocab=4, output_token_ids=[[2], [2]])
    assert plain.output_counts is None and plain.prompt_mask is None


def test_greedy_uses_penalized_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    t = make_tensors(1, vocab=3, temperature=0.0, presence_penalty=1.0, output_token_ids=[[0]])
    assert Sampler()(logits, t).sampled.item() == 1


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(3)
    t = make_tensors(3, temperature=0.0, repetition_penalty=1.5, prompt_token_ids=[[0]] * 3)
    out = Sampler()(logits, t, num_logprobs=4)
    ref = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.sampled[:, None])[:, 0], atol=1e-6)
    top_vals, top_ids = ref.topk(4, dim=-1)
    assert torch.equal(out.top_logprob_ids, top_ids)
    assert torch.allclose(out.top_logprob_values, top_vals, atol=1e-6)
    assert out.logprobs.dtype == torch.float32
    assert Sampler()(logits, t).top_logprob_ids is None


def test_no_logprobs_wanted_returns_none_and_the_same_tokens():
    logits = random_logits(4)
    t = make_tensors(4, temperature=[0.0, 0.0, 0.7, 1.0], seeds=[None, None, 3, 4])
    with_lp = Sampler()(logits, t)
    without = Sampler()(logits, t, logprobs=False)
    assert without.logprobs is None and with_lp.logprobs is not None
    assert torch.equal(without.sampled, with_lp.sampled)
    # top logprobs asked for: computed whatever the flag says
    assert Sampler()(logits, t, num_logprobs=2, logprobs=False).logprobs is not None


def test_cpu_argmax_matches_torch_with_ties_and_nan():
    x = random_logits(6, vocab=300)
    x[1, 3] = x[1, 7] = 1e9  # a tie: the first index
    x[2, 5] = x[2, 9] = float("nan")  # NaN counts as the maximum, first one
    x[3] = float("-inf")
    got = _argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
    assert got[1] == 3 and got[2] == 5


def test_row_count_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler()(random_logits(2), make_tensors(3))
    with pytest.raises(ValueError):
        SamplingTensors.from_lists([1.0], [1.0], [-1], [0.0], [0.0], [0.0], [1.0], [None],
                                   [0, 0], [[]], [[]], V, "cpu")


def test_no_nan_with_extreme_logits():
    logits = torch.full((4, V), -math.inf)
    logits[:, 3] = 0.0
    out = Sampler()(logits, make_tensors(4, seeds=[1, None, 2, None], top_p=0.9, min_p=0.1))
    assert out.sampled.tolist() == [3, 3, 3, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_forward_never_syncs_with_host():
    logits = random_logits(6, device="cuda")
    t = make_tensors(6, temperature=[0.0, 0.7, 1.0, 1.0, 0.5, 1.2], top_k=[-1, 5, -1, 3, -1, -1],
                     top_p=[1.0, 0.9, 0.8, 1.0, 1.0, 0.5], min_p=[0.0, 0.0, 0.1, 0.0, 0.05, 0.0],
                     seeds=[None, 1, None, 2, 3, None], repetition_penalty=1.1,
                     presence_penalty=0.5, prompt_token_ids=[[1, 2]] * 6,
                     output_token_ids=[[3]] * 6, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, t, num_logprobs=3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled.is_cuda and out.sampled[0].item() == logits[0].argmax().item()
