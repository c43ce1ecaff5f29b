"""Steps with prompt tokens padded to token sizes (``worker/mixed_graph.py``) on the CPU:
the sizes, the attention hook the capture splits the forward at, the static inputs of a
hole, the runner's dispatch (pure decodes to the decode graphs, steps with prompt tokens
of up to the largest size to the mixed runner, longer ones eager), and, under
``TRITON_INTERPRET=1``, greedy tokens of a model with sliding and full layers through the
Triton backend with both kinds of step padded equal to its dense reference, and a
warm-up forward that writes no K/V. The capture itself needs a GPU
(``tests/engine/test_mixed_graph_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from cvllm.attention.kv_cache import KVCache
from cvllm.core.kv_cache_manager import KVCacheManager
from cvllm.core.scheduler_output import SchedulerOutput
from cvllm.core.step_builder import build_step_input
from cvllm.layers.attention import split_at_attention
from cvllm.worker import mixed_graph as mg
from cvllm.worker import model_runner as mr
from cvllm.worker import runner_setup as rs
from tests.interpreted import run_interpreted as run_in_interpreter
from tests.worker.test_cuda_graph_padding import (BS, CPU, NEW, PROMPTS, Recorder, TwoWindows,
                                                  _config, _seqs, _with_padding)


def test_token_sizes_double_up_to_the_limit_and_the_step_budget():
    assert mg.token_sizes(512, 8192) == [16, 32, 64, 128, 256, 512]
    assert mg.token_sizes(512, 128) == [16, 32, 64, 128]
    assert mg.token_sizes(100, 8192) == [16, 32, 64, 100]
    assert mg.token_sizes(512, 40) == [16, 32, 40]
    assert mg.token_sizes(8, 8192) == [8]
    assert mg.token_sizes(0, 8192) == []


def _metadata(T):
    from cvllm.attention.metadata import AttentionMetadata
    import numpy as np

    return AttentionMetadata.build(
        slot_mapping=np.arange(T), query_start_loc=np.array([0, T]), seq_lens=np.array([T]),
        block_tables=np.arange(-(-T // BS))[None, :], device=CPU,
        extra_groups=[(6, np.arange(T), np.arange(-(-T // BS))[None, :])])


def _caches(model):
    return [KVCache(torch.zeros(8, BS, model.HKV, model.D), torch.zeros(8, BS, model.HKV, model.D))
            for _ in range(2)]


def test_split_at_attention_routes_every_attention_call_to_the_hook():
    torch.manual_seed(0)
    model = TwoWindows()
    ids, pos = torch.tensor([3, 9, 4, 1, 7]), torch.arange(5)
    want = model(ids, pos, _metadata(5), _caches(model))
    seen = []

    def hook(layer, q, k, v, kv_cache, meta, positions, rotary_emb):
        seen.append(layer)
        return layer.attend(q, k, v, kv_cache, meta, positions, rotary_emb)

    with split_at_attention(model, hook):
        got = model(ids, pos, _metadata(5), _caches(model))
        with pytest.raises(RuntimeError, match="already active"):
            with split_at_attention(model, hook):
                pass
    assert seen == list(model.attn)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ZeroDivisionError):  # the hook is gone after an error too
        with split_at_attention(model, lambda *a: 1 / 0):
            model(ids, pos, _metadata(5), _caches(model))
    torch.testing.assert_close(model(ids, pos, _metadata(5), _caches(model)), want)


def test_only_a_backend_that_takes_out_gets_an_out_tensor():
    model = TwoWindows()  # the CPU's torch reference backend
    q = torch.zeros(2, model.H * model.D)
    kv = torch.zeros(2, model.HKV * model.D)
    with pytest.raises(ValueError, match="takes no out tensor"):
        model.attn[0].attend(q, kv, kv, _caches(model)[0], _metadata(2), out=torch.empty_like(q))


def _mixed(runner, sizes=(16, 32)):
    runner.mixed = mg.MixedGraphRunner(runner.model, runner.kv_caches, sizes=list(sizes),
                                       block_size=BS, windows=runner.kv_layout.windows,
                                       device=CPU, capture=False)
    calls = []
    original = runner.mixed.run
    runner.mixed.run = lambda step, T, meta, prev=None: calls.append(
        (int(step.input_ids.shape[0]), T)) or original(step, T, meta, prev)
    return calls


def test_static_inputs_copy_a_fused_projection_once():
    runner = mg.MixedGraphRunner(torch.nn.Identity(), [], sizes=[16], block_size=BS,
                                 windows=[None], device=CPU, capture=False)
    qkv = torch.randn(16, 40)
    q, k, v = qkv.split([24, 8, 8], -1)
    sq, sk, sv, sp = runner._static_inputs(16, q, k, v, runner.positions[:16])
    for got, want in ((sq, q), (sk, k), (sv, v)):
        assert torch.equal(got, want) and got.stride() == want.stride()
    assert sq.untyped_storage().data_ptr() == sk.untyped_storage().data_ptr() != \
        qkv.untyped_storage().data_ptr()
    assert sp.data_ptr() == runner.positions.data_ptr()  # the static positions as they are
    a, b = torch.randn(16, 24), torch.randn(16, 8)  # separate tensors: one copy each
    sa, sb, sc, sp = runner._static_inputs(16, a, b, b.clone(), torch.arange(16))
    assert torch.equal(sa, a) and torch.equal(sb, b) and torch.equal(sp, torch.arange(16))
    assert sb.data_ptr() != sc.data_ptr()


def test_runner_dispatches_steps_with_prompt_tokens_padded(monkeypatch):
    monkeypatch.setattr(rs, "get_model_class", lambda arch: Recorder)
    config = _config(chunk=64)
    runner = mr.ModelRunner(config, source=None)
    decode_calls = _with_padding(runner)
    calls = _mixed(runner, sizes=(16, 32))
    windows = runner.kv_layout.windows
    prefill = _seqs(KVCacheManager.from_layout(runner.kv_layout), [5, 6], new_tokens=3)
    step = build_step_input(SchedulerOutput(1, prefill), BS, windows)
    res = runner.execute(step, _sampling(prefill))
    ids, meta = runner.model.seen[-1]
    assert calls == [(6, 16)] and ids.shape[0] == 16 and meta.num_tokens == 6
    assert ids.tolist() == step.input_ids.tolist() + [0] * 10
    assert res.token_ids.tolist() == step.input_ids[step.logits_indices].tolist()
    long = _seqs(KVCacheManager.from_layout(runner.kv_layout), [40], new_tokens=33)
    runner.execute(build_step_input(SchedulerOutput(2, long), BS, windows))  # 33 > 32: eager
    assert calls == [(6, 16)] and runner.model.seen[-1][0].shape[0] == 33
    decode = _seqs(KVCacheManager.from_layout(runner.kv_layout), [20, 3])
    runner.execute(build_step_input(SchedulerOutput(3, decode), BS, windows))
    assert decode_calls == [(2, 2)] and calls == [(6, 16)]


def _sampling(scheduled):
    from cvllm.core.sampling_batch import build_sampling_batch

    return build_sampling_batch([s.seq for s in scheduled])


def _generate(mixed: bool):
    from cvllm.engine.llm import LLM
    from cvllm.engine.llm_engine import LLMEngine
    from cvllm.engine.tokenizer import Tokenizer
    from cvllm.sampling_params import SamplingParams
    from tests.worker.tiny_llama import word_tokenizer

    rs.get_model_class = lambda arch: TwoWindows
    config = _config(max_num_seqs=3, backend="triton", chunk=8)
    runner = mr.ModelRunner(config, source=None)
    _with_padding(runner, sizes=(1, 4))
    calls = _mixed(runner, sizes=(16,)) if mixed else []
    llm = LLM.from_engine(LLMEngine(config, Tokenizer(word_tokenizer(TwoWindows.V)), runner))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in NEW]
    return [r.token_ids for r in llm.generate(PROMPTS, params)], calls, runner


def run_interpreted() -> None:
    """Entry point of the interpreter subprocess."""
    tokens, calls, runner = _generate(mixed=True)
    want = [runner.model.dense_greedy(p, n) for p, n in zip(PROMPTS, NEW)]
    assert tokens == want, (tokens, want)
    assert calls and all(T == 16 and n <= 16 for n, T in calls), calls
    caches = [t.clone() for layer in runner.kv_caches for t in layer]
    hidden = runner.mixed.warm_up(16)
    assert hidden.shape == (16, TwoWindows.HID) and torch.isfinite(hidden).all()
    after = [t for layer in runner.kv_caches for t in layer]
    assert all(torch.equal(a, b) for a, b in zip(caches, after))  # no K/V written


def test_padded_mixed_tokens_match_dense_interpreted_on_cpu():
    code = "from tests.worker.test_mixed_graph_padding import run_interpreted; run_interpreted()"
    run_in_interpreter(code, timeout=600)


def test_only_backends_that_run_between_pieces_are_split():
    assert "torch_ref cannot run between graph pieces" in mg.split_unsafe_reason(TwoWindows())
    assert mg.split_unsafe_reason(TwoWindows(backend="triton")) is None


def test_cpu_runner_builds_no_mixed_runner(monkeypatch):
    monkeypatch.setattr(rs, "get_model_class", lambda arch: TwoWindows)
    runner = mr.ModelRunner(_config(backend="triton"), source=None)
    assert runner.graphs is None and runner.mixed is None
