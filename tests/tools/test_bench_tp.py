"""tools/bench_tp.py's parts that need no GPU: the agreement of greedy outputs across TP
sizes (identical, a divergence between tokens in each other's top 5, or a problem) and
its arguments. The probe against a real server is in test_bench_serving.py."""

import bench_tp


def _out(tokens, tops):
    return {"tokens": tokens, "top": tops}


def test_compare_greedy_identical_top5_and_problems():
    t = {"a": -0.1, "b": -0.2, "c": -3.0}
    base = [_out(["a", "b"], [t, t]), _out(["a", "b"], [t, t]), _out(["a", "c"], [t, t]),
            _out(["a", "b"], [t, t])]
    other = [_out(["a", "b"], [t, t]),                        # identical
             _out(["b", "a"], [{"b": -0.1, "a": -0.12}, t]),  # near tie: in each other's top 5
             _out(["a", "x"], [t, {"x": -0.1, "q": -1.0}]),   # "c" not in other's top 5
             _out(["a"], [t])]                                # shorter
    res = bench_tp.compare_greedy(base, other)
    assert res["identical"] == 1 and res["diverged_in_top5"] == 1 and not res["agrees"]
    assert len(res["problems"]) == 2 and "token 1" in res["problems"][0]
    assert "lengths" in res["problems"][1]
    d = res["divergences"][0]
    assert (d["prompt"], d["position"], d["base_token"], d["other_token"]) == (1, 0, "a", "b")
    assert d["base_logprobs"] == [-0.1, -0.2] and d["other_logprobs"] == [-0.12, -0.1]
    assert bench_tp.compare_greedy(base[:1], other[:1])["agrees"]
    assert not bench_tp.compare_greedy(base[:2], other[:1])["agrees"]


def test_arguments_and_fixed_prompts():
    args = bench_tp.parse_args(["--isq", "q4k", "--agree-prompts", "0"])
    assert args.isq == "q4k" and args.agree_prompts == 0 and args.agree_tokens == 32
    assert bench_tp.parse_args([]).isq is None
    a, b = bench_tp.agreement_prompts(4, vocab=500), bench_tp.agreement_prompts(4, vocab=500)
    assert a == b and len(a) == 4 and all(0 <= t < 500 for p in a for t in p)
