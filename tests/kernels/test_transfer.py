"""Host -> device copies on the step path never wait for the device (kernels/transfer.py).

A copy from pageable memory makes CUDA synchronize the stream first: queued behind a long
kernel, it would hold the host until the kernel ends. These tests queue a 0.5 s device
sleep and check the copies return long before it ends (a property of the overlapped loop,
not a speed target: the margin is 10x)."""

import time

import numpy as np
import pytest
import torch

from cvllm.kernels.transfer import to_device
from tests.interpreted import run_interpreted

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_copies_are_the_array_itself_or_a_cast():
    a = np.arange(6, dtype=np.int32)
    t = to_device(a, "cpu")
    assert t.dtype == torch.int32 and t.tolist() == list(range(6))
    assert to_device(a, "cpu", torch.int64).dtype == torch.int64


def _busy_device(seconds: float) -> None:
    torch.cuda.synchronize()
    cycles = int(seconds * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # kHz -> Hz
    torch.cuda._sleep(cycles)


@pytest.mark.gpu
@cuda
def test_copies_do_not_wait_for_queued_work():
    from cvllm.attention.metadata import AttentionMetadata
    from cvllm.layers.sampling_tensors import SamplingTensors

    def copies():
        x = to_device(np.arange(4096, dtype=np.int64), "cuda")
        S = 64
        SamplingTensors.from_lists(
            temperature=[0.7] * S, top_p=[0.9] * S, top_k=[50] * S, min_p=[0.0] * S,
            presence_penalty=[0.1] * S, frequency_penalty=[0.0] * S,
            repetition_penalty=[1.1] * S, seeds=[3] * S, output_index=[0] * S,
            prompt_token_ids=[[1, 2]] * S, output_token_ids=[[3]] * S, vocab_size=1000,
            device="cuda", mask_rows=np.arange(S),
            bitmask=np.full((S, 32), -1, dtype=np.int32)).temperature  # (copied when read)
        AttentionMetadata.build(slot_mapping=np.arange(S), query_start_loc=np.arange(S + 1),
                                seq_lens=np.full(S, 5), block_tables=np.zeros((S, 1)),
                                device=torch.device("cuda"))
        return x

    copies()  # warm: the first pinned blocks are allocated (cudaHostAlloc synchronizes)
    _busy_device(0.5)
    t0 = time.perf_counter()
    x = copies()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert host_s < 0.05, f"the copies waited {host_s:.3f} s for the device"
    assert x[-1].item() == 4095


def check_patch_ids(device="cpu"):
    """``patch_ids_`` against the torch form: placeholders anywhere, rows taken out of
    order and twice, more rows than one program covers."""
    from cvllm.kernels.transfer import patch_ids_
    from cvllm.worker.cuda_graph import patch_placeholders

    g = torch.Generator().manual_seed(0)
    for T in (1, 7, 2500):
        ids = torch.randint(0, 50000, (T,), generator=g)
        rows = torch.randint(-1, 9, (T,), generator=g)
        prev = torch.randint(0, 50000, (9,), generator=g)
        want = patch_placeholders(ids, rows, prev)
        got = patch_ids_(ids.to(device), rows.to(device), prev.to(device))
        assert torch.equal(got.cpu(), want)


def test_patch_ids_interpreted_on_cpu():
    run_interpreted("from tests.kernels.test_transfer import check_patch_ids; check_patch_ids()")


@pytest.mark.gpu
@cuda
def test_patch_ids_cuda():
    check_patch_ids("cuda")
