"""tools/bench_read_twins.py's load-only twin reads exactly the GEMV's bytes: its xor over
each program's tile equals the xor of the same words taken in torch (CPU, interpreted)."""

from tests.interpreted import run_interpreted


def run_cpu_cases() -> None:
    import functools

    import torch

    import bench_read_twins as rt
    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant.ggml_types import GgmlType
    from tests.kernels.test_ggml_cuda import random_raw

    def xor(t: torch.Tensor) -> int:
        return functools.reduce(lambda a, b: a ^ b, t.reshape(-1).tolist(), 0)

    n, k = 40, 1024
    w = gc.prepare(random_raw(GgmlType.Q4_K, n, k, device="cpu"), GgmlType.Q4_K)
    (lo, _hi, d, _dm, sc), _ = w.args
    lo, d, sc = lo.view(n, -1), d.view(n, -1), sc.view(n, -1).to(torch.int32)
    for bn, bk, split in ((16, 512, 1), (8, 256, 2), (16, 256, 3)):
        out = rt.read_twin(w, bn, bk, 4, split)
        progs, split, steps = rt.twin_grid(n, k, bn, bk, split)
        assert out.shape == (progs,)
        for pid in range(progs):
            rows = torch.arange(pid // split * bn, pid // split * bn + bn).clamp(max=n - 1)
            k_lo = pid % split * steps * bk
            k_hi = min(k, k_lo + steps * bk)
            want = xor(lo[rows, k_lo // 8:k_hi // 8])
            want ^= xor(sc[rows, k_lo // 32:k_hi // 32])
            subs = torch.arange(k_lo // 32, k_hi // 32)
            want ^= xor(d[rows][:, subs // 8])
            assert int(out[pid]) == want, (bn, bk, split, pid)
    words = lo.numel()
    out = torch.empty(3, dtype=torch.int32)
    rt.flat_read_kernel[(3,)](lo, out, words, BLOCK=64, num_warps=4)
    assert xor(out) == xor(lo)


def test_read_twin_reads_the_gemv_bytes_interpreted():
    run_interpreted("import sys; sys.path.insert(0, 'tools'); "
                    "from tests.tools.test_bench_read_twins import run_cpu_cases; "
                    "run_cpu_cases()")
