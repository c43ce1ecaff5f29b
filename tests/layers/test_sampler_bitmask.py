"""The sampler's structured-output bitmask: unpacking, masking, and what it leaves alone."""

import numpy as np
import pytest
import torch

from cvllm.layers.sampler import Sampler
from cvllm.layers.sampling_tensors import unpack_bitmask
from tests.layers import test_sampler as base
from tests.layers.test_sampler import DEVICES, random_logits

V = 70  # not a multiple of 32: the last word is partly padding


def bitmask_of(allowed_rows, vocab=V):
    """Pack lists of allowed ids into [R, W] int32 (bit j of word i = token 32 i + j)."""
    words = -(-vocab // 32)
    out = np.zeros((len(allowed_rows), words), dtype=np.uint32)
    for r, ids in enumerate(allowed_rows):
        for t in ids:
            out[r, t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


def make_tensors(n, mask_rows=None, bitmask=None, **kw):
    """test_sampler's helper, plus the mask (beside the per-row lists)."""
    defaults = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0,
                    frequency_penalty=0.0, repetition_penalty=1.0, seeds=None, output_index=0,
                    prompt_token_ids=(), output_token_ids=())
    vocab, device = kw.pop("vocab", base.V), kw.pop("device", "cpu")
    defaults.update(kw)
    cols = {k: (v if isinstance(v, list) else [v] * n) for k, v in defaults.items()}
    rows = None if mask_rows is None else np.asarray(mask_rows)
    return base.SamplingTensors.from_lists(**cols, vocab_size=vocab, device=device,
                                           mask_rows=rows, bitmask=bitmask)


def test_unpack_matches_the_bit_layout():
    rows = [[0, 31, 32, 69], [5], list(range(V))]
    allowed = unpack_bitmask(torch.from_numpy(bitmask_of(rows)), V)
    assert allowed.shape == (3, V) and allowed.dtype == torch.bool
    for r, ids in enumerate(rows):
        assert allowed[r].nonzero().flatten().tolist() == sorted(ids)


def test_a_row_that_allows_nothing_allows_everything():
    allowed = unpack_bitmask(torch.from_numpy(bitmask_of([[], [3]])), V)
    assert bool(allowed[0].all()) and allowed[1].sum() == 1


def test_too_few_words_is_an_error():
    with pytest.raises(ValueError, match="cannot cover"):
        unpack_bitmask(torch.zeros(1, 2, dtype=torch.int32), V)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_rows_take_only_allowed_tokens(device, temperature):
    S = 6
    logits = random_logits(S, V, seed=3, device=device)
    rows = [1, 4]
    allowed = [[7, 40, 69], [0]]
    sampler = Sampler()
    seen = {1: set(), 4: set()}
    for seed in range(40):
        t = make_tensors(S, vocab=V, device=device, temperature=temperature, seeds=seed,
                         mask_rows=rows, bitmask=bitmask_of(allowed))
        out = sampler(logits, t, logprobs=True)
        for r, ids in zip(rows, allowed):
            tok = int(out.sampled[r])
            assert tok in ids
            seen[r].add(tok)
        free = make_tensors(S, vocab=V, device=device, temperature=temperature, seeds=seed)
        ref = sampler(logits, free)
        other = [i for i in range(S) if i not in rows]
        # unconstrained rows sample exactly as without any mask (same seeds)
        assert out.sampled[other].tolist() == ref.sampled[other].tolist()
        # logprobs stay the model's raw ones, mask or not
        raw = torch.log_softmax(logits.float(), -1).gather(1, out.sampled[:, None]).squeeze(1)
        torch.testing.assert_close(out.logprobs, raw, atol=1e-5, rtol=1e-5)
    if temperature > 0:
        assert len(seen[1]) > 1  # sampling among the allowed ones, not always the same
    else:
        best = max(allowed[0], key=lambda t: float(logits[1, t]))
        assert seen[1] == {best}


def test_logits_are_not_modified_in_place():
    logits = random_logits(2, V)
    before = logits.clone()
    t = make_tensors(2, vocab=V, temperature=0.0, mask_rows=[0], bitmask=bitmask_of([[1]]))
    assert int(Sampler()(logits, t).sampled[0]) == 1
    assert torch.equal(logits, before)
