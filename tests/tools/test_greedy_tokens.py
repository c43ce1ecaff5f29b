"""tools/greedy_tokens.py: the records committed under docs/benchmarks/ (every family's
greedy tokens and their logprobs on the CPU, with and without the flat decode loop,
before and after the model code moved onto the shared blocks of ``models/blocks.py``)
are equal, and the comparison names what differs. The records are not re-run here: their
logprobs are exact floats of one machine's kernels (``python -m tools.greedy_tokens
--compare docs/benchmarks/greedy-tokens-after.json`` re-runs them on this one)."""

import copy
import json
from pathlib import Path

import greedy_tokens

RECORDS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
BEFORE, AFTER = RECORDS / "greedy-tokens-before.json", RECORDS / "greedy-tokens-after.json"


def test_every_family_decodes_the_same_tokens_after_the_shared_blocks():
    before, after = (json.loads(p.read_text()) for p in (BEFORE, AFTER))
    assert set(before) >= set(greedy_tokens.FAMILIES)  # every family was recorded
    assert greedy_tokens.compare(before, after) == []
    assert greedy_tokens.main(["--compare-only", str(BEFORE), str(AFTER)]) == 0
    flat = {name for name, modes in after.items() if modes["default"]["flat_decode"]}
    assert {"llama", "qwen3", "smollm2_gguf_q4_1"} <= flat  # the loop was measured too
    assert not any(modes["disable_cuda_graph"]["flat_decode"] for modes in after.values())


def test_compare_names_each_difference():
    before = json.loads(AFTER.read_text())
    after = copy.deepcopy(before)
    after["qwen3"]["default"]["batch"][1][5] += 1
    after["gemma2"]["disable_cuda_graph"]["logprobs"][0][0] -= 1e-7
    del after["glm4"]
    assert greedy_tokens.compare(before, after) == [
        "glm4: only in the first",
        "gemma2 [disable_cuda_graph]: logprobs differ",
        "qwen3 [default]: batch differ",
    ]
