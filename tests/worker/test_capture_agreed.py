"""worker/cuda_graph.capture_agreed: the CUDA-graph capture loop of the decode and the
mixed-step graphs, agreed across tensor-parallel ranks size by size. Run here on CPU rank
threads (the --multithread group), with capture functions standing in for the GPU's:
a capture that fails on one rank only (out of memory, say) must stop every rank at that
size, before the next size's warm-up runs collectives the failed rank would never join,
and every rank must fall back alike. Also: the attention hook is per model (each rank
thread runs its own)."""

import logging
import threading

import pytest
import torch

from cvllm.distributed import parallel_state
from cvllm.distributed.inprocess import run_ranks
from cvllm.layers import attention
from cvllm.worker.cuda_graph import capture_agreed


def _ranks(world, fn):
    def body(rank, group):
        view = group.rank_view(rank)
        parallel_state.initialize_model_parallel(rank, world, view, view, thread_local=True)
        try:
            return fn(rank)
        finally:
            parallel_state.destroy_model_parallel()
    return run_ranks(world, body, timeout_s=30)


def test_all_sizes_captured_largest_first():
    def fn(rank):
        seen = []
        return capture_agreed([4, 1, 16, 8], seen.append, "eager"), seen

    assert _ranks(2, fn) == [(True, [16, 8, 4, 1])] * 2


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), ValueError("bad")])
def test_one_rank_failing_stops_every_rank_at_that_size(error, caplog):
    """Rank 1 fails at size 8 (any exception, not only a RuntimeError): both ranks stop
    after size 8 and report False; rank 0 never warms size 4 up alone."""
    def fn(rank):
        seen = []

        def capture_one(size):
            seen.append(size)
            if rank == 1 and size == 8:
                raise error
        return capture_agreed([1, 4, 8, 16], capture_one, "steps run eagerly"), seen

    with caplog.at_level(logging.WARNING, logger="cvllm.worker"):
        results = _ranks(2, fn)
    assert results == [(False, [16, 8])] * 2
    text = caplog.text
    assert "size 8" in text and type(error).__name__ in text  # the failed rank says why
    assert "another tensor-parallel rank's capture failed" in text  # the other says so


def test_single_rank_failure_falls_back(caplog):
    def capture_one(size):
        if size == 2:
            raise RuntimeError("capture broke")

    with caplog.at_level(logging.WARNING, logger="cvllm.worker"):
        assert capture_agreed([1, 2, 4], capture_one, "decode steps run eagerly") is False
    assert "capture broke" in caplog.text and "decode steps run eagerly" in caplog.text


def test_attention_hook_is_per_model():
    """Under --multithread each rank thread captures its own model at once: one rank's
    split_at_attention must not divert another rank's attention calls."""
    mine, other = (torch.nn.ModuleList([attention.Attention(2, 4, 0.5)]) for _ in range(2))
    inside, checked = threading.Event(), threading.Event()
    seen = {}

    def capturing():
        with attention.split_at_attention(mine, lambda *a: None):
            seen["own"] = mine[0].split_hook is not None
            inside.set()
            checked.wait(10)

    t = threading.Thread(target=capturing)
    t.start()
    assert inside.wait(10)
    seen["other"] = other[0].split_hook
    checked.set()
    t.join(10)
    assert seen == {"own": True, "other": None}
    assert mine[0].split_hook is None  # free again once the capture is done
    with attention.split_at_attention(mine, lambda *a: None):
        with attention.split_at_attention(other, lambda *a: None):  # another model: free
            with pytest.raises(RuntimeError, match="already active"):
                with attention.split_at_attention(mine, lambda *a: None):
                    pass
