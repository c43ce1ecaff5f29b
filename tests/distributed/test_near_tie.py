"""``assert_greedy_within_near_tie``, the property the quantized TP tests hold (see
``tests/e2e/test_tp_generate.LOGPROB_TOL``): it accepts equal generations and a parting
at a near-tie, and refuses a parting that is no tie, a drift of log-probabilities before
it, and a token the other side does not rank."""

import pytest

from tests.distributed.tp_helpers import assert_greedy_within_near_tie


def _row(ids, lps, tops):
    return {"token_ids": ids, "logprobs": lps, "top_logprobs": tops}


REF = _row([5, 6, 7], [-0.1, -0.7, -0.2],
           [[[5, -0.1], [9, -3.0]], [[6, -0.7], [8, -0.8]], [[7, -0.2], [1, -2.0]]])


def test_equal_and_near_tie_pass():
    assert_greedy_within_near_tie([REF], [REF], 0.3)
    parted = _row([5, 8, 3], [-0.15, -0.72, -1.0],
                  [[[5, -0.15], [9, -2.9]], [[8, -0.72], [6, -0.75]], [[3, -1.0]]])
    assert_greedy_within_near_tie([REF], [parted], 0.3)


@pytest.mark.parametrize("got", [
    # log-probability drift before any parting
    _row([5, 6, 7], [-0.9, -0.7, -0.2], REF["top_logprobs"]),
    # parting where the reference's token is far more likely (no tie)
    _row([5, 9, 3], [-0.1, -0.1, -1.0],
         [[[5, -0.1], [9, -3.0]], [[9, -0.1], [6, -2.5]], [[3, -1.0]]]),
    # parting to a token the reference does not rank at all
    _row([5, 4, 3], [-0.1, -0.7, -1.0],
         [[[5, -0.1], [9, -3.0]], [[4, -0.7], [6, -0.72]], [[3, -1.0]]]),
    # same tokens, but one stopped early
    _row([5, 6], [-0.1, -0.7], REF["top_logprobs"][:2]),
])
def test_no_tie_fails(got):
    with pytest.raises(AssertionError):
        assert_greedy_within_near_tie([REF], [got], 0.3)
