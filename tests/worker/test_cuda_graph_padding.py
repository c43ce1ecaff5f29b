"""Padded decode steps (``worker/cuda_graph.py``) on the CPU: the capture sizes, the
staging of a step into the static buffers (``worker/decode_buffers.py``; padding rows get
slot -1 and seq_len 0, so they write no KV and read nothing; freed sliding blocks are
clamped), the metadata made of views of those buffers (constant sizes: every row a
decode, ``max_model_len`` as the decode bound), which models may be captured, the
runner's dispatch and, under ``TRITON_INTERPRET=1``, greedy tokens of a model with
sliding and full layers through the Triton backend with decode steps padded equal to its
dense reference."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cvllm.attention.specs import FullAttentionSpec, MLASpec, SlidingWindowSpec
from cvllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from cvllm.core.sampling_batch import build_sampling_batch
from cvllm.core.kv_cache_manager import KVCacheManager
from cvllm.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cvllm.core.sequence import Sequence
from cvllm.core.step_builder import build_step_input
from cvllm.layers.attention import Attention
from cvllm.sampling_params import SamplingParams
from cvllm.worker import cuda_graph as cg
from cvllm.worker import decode_buffers as db
from cvllm.worker import model_runner as mr
from cvllm.worker import runner_setup as rs
from tests.interpreted import run_interpreted as run_in_interpreter

F32 = torch.float32
CPU = torch.device("cpu")


def test_capture_sizes_follow_vllm():
    s = cg.capture_sizes(256)
    assert s[:5] == [1, 2, 4, 8, 16] and s[-1] == 256 and len(s) == 35
    assert all(b - a == 8 for a, b in zip(s[3:], s[4:]))
    assert cg.capture_sizes(1) == [1]
    assert cg.capture_sizes(5) == [1, 2, 4, 5]
    assert cg.capture_sizes(8) == [1, 2, 4, 8]
    assert cg.capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert cg.capture_sizes(1000)[-1] == cg.CAPTURE_SIZE_LIMIT == 512
    with pytest.raises(ValueError):
        cg.capture_sizes(0)


def test_padded_batch_size_is_the_smallest_size_that_fits():
    sizes = cg.capture_sizes(30)
    assert [cg.padded_batch_size(n, sizes) for n in (1, 2, 3, 4, 5, 9, 17, 24, 25, 30)] == \
        [1, 2, 4, 4, 8, 16, 24, 24, 30, 30]
    assert cg.padded_batch_size(31, sizes) is None and cg.padded_batch_size(0, sizes) is None


# ----- steps --------------------------------------------------------------------------------

BS = 8  # block size
WINDOWS = [None, 6]


def _layout():
    from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout

    groups = (KVCacheGroupConfig(None, 40, (0,)), KVCacheGroupConfig(6, 40, (1,)))
    return KVCacheLayout(BS, groups, 0)


def _decode_step(kv, lens, step_id=1, free_sliding=True):
    """Sequences with ``lens`` tokens, all computed but the last: a pure-decode step."""
    scheduled = []
    for i, n in enumerate(lens):
        seq = Sequence(i, f"r{i}", list(range(3, 3 + n)), SamplingParams())
        kv.allocate(seq, n)
        seq.num_computed_tokens = n - 1
        scheduled.append(ScheduledSeq(seq, 1, True))
    if free_sliding:  # drop sliding blocks no query can see any more (-1 in the tables)
        for s in scheduled:
            kv.remove_out_of_window_blocks(s.seq)
    out = SchedulerOutput(step_id, scheduled)
    return build_step_input(out, BS, WINDOWS)


def _buffers():
    return db.DecodeBuffers(max_bs=8, max_blocks=64 // BS, num_groups=2, device=CPU)


@pytest.mark.parametrize("direct", [True, False])
def test_staging_pads_rows_so_they_write_and_read_nothing(monkeypatch, direct):
    """Narrow steps copy their block tables into place with the other inputs (one copy);
    wide ones (here: every step, the limit set to 0) copy them compact and spread them."""
    if not direct:
        monkeypatch.setattr(db, "DIRECT_TABLE_BYTES", 0)
    kv = KVCacheManager.from_layout(_layout())
    step = _decode_step(kv, [20, 3, 33])
    assert (step.group_block_tables[0] == -1).any()  # freed sliding blocks
    b = _buffers()
    b.load(step, 4)
    assert b.num_copies == (1 if direct else 2)
    assert b.input_ids[:4].tolist() == step.input_ids.tolist() + [0]
    assert b.positions[:4].tolist() == [19, 2, 32, 0]
    assert b.seq_lens[:4].tolist() == [20, 3, 33, 0]
    for g in range(2):
        _, slots, tables = step.kv_group(g)
        assert b.slot_mapping[g][:4].tolist() == slots.tolist() + [-1]
        m = tables.shape[1]
        assert b.block_tables[g][:3, :m].tolist() == np.maximum(tables, 0).tolist()
        assert b.block_tables[g][3, :m].tolist() == [0] * m
    # A smaller step later: its padding overwrites the previous step's rows.
    step2 = _decode_step(KVCacheManager.from_layout(_layout()), [9], step_id=2)
    b.load(step2, 2)
    assert b.seq_lens[:2].tolist() == [9, 0]
    assert b.slot_mapping[0][:2].tolist() == [step2.slot_mapping[0], -1]
    assert b.slot_mapping[1][1].item() == -1


def test_previous_ids_are_put_where_the_forward_patches_from():
    b = _buffers()
    b.take_prev(torch.tensor([5, 6, 7]))
    assert b.sampled[:3].tolist() == [5, 6, 7]
    b.take_prev(b.sampled[:3])  # already there (a greedy step sampled in the graph)
    assert b.sampled[:3].tolist() == [5, 6, 7]
    with pytest.raises(Exception, match="sampled 9 rows"):
        b.take_prev(torch.zeros(9, dtype=torch.int64))
    assert db.DecodeBuffers(8, 8, 1, CPU, sampled_rows=12).sampled.shape == (12,)


def test_pending_tokens_counted_from_patched_inputs_equal_those_from_prev():
    """Penalties in the overlapped loop: a decode graph overwrites the previous ids with
    its own greedy ids, so the runner counts the placeholders' tokens from the step's
    patched inputs instead; both give the same counts."""
    kv = KVCacheManager.from_layout(_layout())
    step = _decode_step(kv, [20, 3, 33])
    step.prev_rows[:] = [1, -1, 0]
    prev = torch.tensor([11, 22])
    inputs = cg.patch_placeholders(torch.as_tensor(step.input_ids), torch.as_tensor(step.prev_rows),
                                   prev)
    counts = [torch.zeros(3, 40) for _ in range(2)]
    mr._count_pending_tokens(counts[0], step, prev)
    mr._count_pending_tokens(counts[1], step, prev, inputs)
    assert torch.equal(counts[0], counts[1])
    assert counts[0][0, 22] == 1 and counts[0][2, 11] == 1 and counts[0].sum() == 2


def test_staging_refuses_steps_that_do_not_fit():
    step = _decode_step(KVCacheManager.from_layout(_layout()), [20, 3, 33])
    with pytest.raises(Exception, match="does not fit"):
        _buffers().load(step, 2)  # 3 rows at size 2
    small = db.DecodeBuffers(max_bs=8, max_blocks=2, num_groups=2, device=CPU)
    with pytest.raises(Exception, match="does not fit"):
        small.load(step, 4)  # 5 block columns > 2


def test_metadata_is_made_of_views_of_the_buffers():
    runner = cg.CudaGraphRunner(nn.Identity(), [], sizes=[1, 2, 4, 8], max_model_len=64,
                                block_size=BS, windows=WINDOWS, device=CPU, capture=False)
    assert not runner.capture_enabled  # never on the CPU
    meta = runner.metadata(4)
    assert runner.metadata(4) is meta  # built once per size
    b = runner.buffers
    assert (meta.num_tokens, meta.num_seqs, meta.num_decodes, meta.max_query_len) == (4, 4, 4, 1)
    assert meta.decode_max_seq_len == meta.max_seq_len == 64
    assert meta.prefill_max_query_len == 0
    for t, buf in ((meta.slot_mapping, b.slot_mapping[0]), (meta.seq_lens, b.seq_lens),
                   (meta.block_tables, b.block_tables[0]),
                   (meta.query_start_loc, b.query_start_loc)):
        assert t.data_ptr() == buf.data_ptr()
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    sliding = meta.view(6)
    assert sliding.sliding_window == 6
    assert sliding.block_tables.data_ptr() == b.block_tables[1].data_ptr()
    assert sliding.slot_mapping.data_ptr() == b.slot_mapping[1].data_ptr()
    assert meta.view(None) is meta and meta.block_tables.shape == (4, 8)


def test_is_pure_decode():
    kv = KVCacheManager.from_layout(_layout())
    assert cg.is_pure_decode(_decode_step(kv, [5, 7]))
    seq = Sequence(9, "p", [1, 2, 3], SamplingParams())
    kv.allocate(seq, 3)
    prefill = build_step_input(SchedulerOutput(3, [ScheduledSeq(seq, 3, True)]), BS, WINDOWS)
    assert not cg.is_pure_decode(prefill)


# ----- which models -------------------------------------------------------------------------


class TwoWindows(nn.Module):
    """Embedding, then x += o(attention(qkv(x))) per layer (windows None and 6): every
    row independent of the others, as padding needs. Has a dense reference."""

    V, HID, H, HKV, D = 64, 32, 4, 2, 16

    def __init__(self, model_config=None, quant_config=None, backend=None):
        super().__init__()
        V, HID, H, HKV, D = self.V, self.HID, self.H, self.HKV, self.D
        if backend is None:  # as the model families do: the engine config's, resolved
            backend = model_config.attention_backend if model_config is not None else "auto"
        self.embed = nn.Embedding(V, HID)
        self.qkv = nn.ModuleList(nn.Linear(HID, (H + 2 * HKV) * D) for _ in WINDOWS)
        self.o = nn.ModuleList(nn.Linear(H * D, HID) for _ in WINDOWS)
        self.attn = nn.ModuleList(Attention(H, D, D**-0.5, HKV, sliding_window=w, backend=backend)
                                  for w in WINDOWS)
        self.head = nn.Linear(HID, V)

    def init_dummy_weights(self, seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    @property
    def sizes(self):
        return [self.H * self.D, self.HKV * self.D, self.HKV * self.D]

    def forward(self, input_ids, positions, attn_metadata, kv_caches):
        x = self.embed(input_ids)  # [T, hidden]
        for i in range(len(WINDOWS)):
            q, k, v = self.qkv[i](x).split(self.sizes, -1)
            x = x + self.o[i](self.attn[i](q, k, v, kv_caches[i], attn_metadata))
        return x

    def compute_logits(self, hidden):
        return self.head(hidden).float()

    @torch.no_grad()
    def dense_greedy(self, prompt, n):
        ids = list(prompt)
        for _ in range(n):
            x = self.embed(torch.tensor(ids))
            L, pos = len(ids), torch.arange(len(ids))
            for i, w in enumerate(WINDOWS):
                q, k, v = (t.view(L, -1, self.D).transpose(0, 1)
                           for t in self.qkv[i](x).split(self.sizes, -1))
                mask = pos[None, :] <= pos[:, None]
                if w:
                    mask &= pos[None, :] > pos[:, None] - w
                k, v = (t.repeat_interleave(self.H // self.HKV, 0) for t in (k, v))
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.D**-0.5)
                x = x + self.o[i](o.transpose(0, 1).reshape(L, -1))
            ids.append(int(self.compute_logits(x)[-1].argmax()))
        return ids[len(prompt):]


def test_only_triton_attention_models_are_padded_and_captured():
    specs = [FullAttentionSpec(2, 16, F32), SlidingWindowSpec(2, 16, F32, 6)]
    assert "torch_ref" in cg.graph_unsafe_reason(TwoWindows(), specs)  # CPU default
    model = TwoWindows(backend="triton")
    assert cg.graph_unsafe_reason(model, specs) is None
    assert "MLASpec" in cg.graph_unsafe_reason(model, specs + [MLASpec(4, 4, F32)])
    assert "no paged attention" in cg.graph_unsafe_reason(nn.Linear(2, 2), specs)


def _config(max_num_seqs=4, backend="auto", chunk=8):
    hf = dict(hidden_size=TwoWindows.HID, num_hidden_layers=2, num_attention_heads=TwoWindows.H,
              num_key_value_heads=TwoWindows.HKV, vocab_size=TwoWindows.V,
              max_position_embeddings=64)
    return EngineConfig(
        model=ModelConfig("TwoWindows", hf), device=DeviceConfig(), load_format="dummy",
        cache=CacheConfig(block_size=BS, num_blocks=48),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, prefill_chunk_size=chunk),
        attention_backend=backend,
    )


def _runner(monkeypatch, config):
    monkeypatch.setattr(rs, "get_model_class", lambda arch: TwoWindows)
    return mr.ModelRunner(config, source=None)


def test_cpu_runner_is_eager_and_backend_follows_the_config(monkeypatch):
    runner = _runner(monkeypatch, _config())
    assert runner.graphs is None
    assert {a.backend.name for a in runner.model.attn} == {"torch_ref"}
    runner = _runner(monkeypatch, _config(backend="triton"))
    assert {a.backend.name for a in runner.model.attn} == {"triton"}


def _with_padding(runner, sizes=(1, 2, 4)):
    """What the runner builds on CUDA, eager (the CPU cannot capture)."""
    runner.graphs = cg.CudaGraphRunner(
        runner.model, runner.kv_caches, sizes=list(sizes), max_model_len=64, block_size=BS,
        windows=runner.kv_layout.windows, device=CPU, capture=False)
    calls = []
    original = runner.graphs.run
    runner.graphs.run = lambda step, bs, prev=None: calls.append(
        (int(step.seq_lens.shape[0]), bs)) or original(step, bs, prev)
    return calls


class Recorder(nn.Module):
    """hidden = one-hot of the input id: greedy sampling returns each row's own input."""

    def __init__(self, model_config=None, quant_config=None):
        super().__init__()
        self.seen = []

    def init_dummy_weights(self, seed):
        pass

    def forward(self, input_ids, positions, attn_metadata, kv_caches):
        self.seen.append((input_ids.clone(), attn_metadata))
        return F.one_hot(input_ids, TwoWindows.V).float() + 0.01 * positions[:, None]

    def compute_logits(self, hidden):
        return hidden


def _seqs(kv, lens, new_tokens=1):
    out = []
    for i, n in enumerate(lens):
        s = Sequence(i, f"r{i}", [(7 * i + j) % 60 + 3 for j in range(n)],
                     SamplingParams(temperature=0.0))
        kv.allocate(s, n)
        s.num_computed_tokens = n - new_tokens
        out.append(ScheduledSeq(s, new_tokens, True))
    return out


def test_runner_dispatches_pure_decode_steps_padded(monkeypatch):
    monkeypatch.setattr(rs, "get_model_class", lambda arch: Recorder)
    runner = mr.ModelRunner(_config(), source=None)  # one full-attention group
    calls = _with_padding(runner)
    kv = KVCacheManager.from_layout(runner.kv_layout)
    sched = _seqs(kv, [20, 3, 33])
    step = build_step_input(SchedulerOutput(1, sched), BS, runner.kv_layout.windows)
    res = runner.execute(step, build_sampling_batch([s.seq for s in sched]))
    ids, meta = runner.model.seen[-1]
    assert calls == [(3, 4)] and ids.tolist() == step.input_ids.tolist() + [0]
    assert meta.num_tokens == 4 and meta.slot_mapping[3].item() == -1
    assert res.token_ids.tolist() == step.input_ids.tolist()  # each real row's own token
    assert runner.output_copy.num_copies == 1
    # A step with a prefill, or more rows than the largest size, runs eagerly, unpadded.
    prefill = _seqs(KVCacheManager.from_layout(runner.kv_layout), [5, 6], new_tokens=2)
    runner.execute(build_step_input(SchedulerOutput(2, prefill), BS, runner.kv_layout.windows))
    wide = _seqs(KVCacheManager.from_layout(runner.kv_layout), [4, 5, 6, 7, 8])
    runner.execute(build_step_input(SchedulerOutput(3, wide), BS, runner.kv_layout.windows))
    assert calls == [(3, 4)] and runner.model.seen[-1][1].num_tokens == 5


# ----- end to end, interpreted ------------------------------------------------------------

PROMPTS = [[3, 17, 9, 4, 50, 31, 8], [7, 7, 1, 20, 45, 13, 8, 41, 12, 60, 5, 19, 23],
           [10, 2, 33, 44, 55]]
NEW = [12, 7, 4]  # rows finish at different steps: 3, then 2, then 1 decoding


def _generate(padded: bool):
    from cvllm.engine.llm import LLM
    from cvllm.engine.llm_engine import LLMEngine
    from cvllm.engine.tokenizer import Tokenizer
    from tests.worker.tiny_llama import word_tokenizer

    rs.get_model_class = lambda arch: TwoWindows
    config = _config(max_num_seqs=3, backend="triton", chunk=8)
    runner = mr.ModelRunner(config, source=None)
    calls = _with_padding(runner, sizes=(1, 4)) if padded else []
    llm = LLM.from_engine(LLMEngine(config, Tokenizer(word_tokenizer(TwoWindows.V)), runner))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in NEW]
    return [r.token_ids for r in llm.generate(PROMPTS, params)], calls, runner


def run_interpreted() -> None:
    """Entry point of the interpreter subprocess."""
    eager, _, runner = _generate(padded=False)
    padded, calls, _ = _generate(padded=True)
    want = [runner.model.dense_greedy(p, n) for p, n in zip(PROMPTS, NEW)]
    assert eager == want, (eager, want)
    assert padded == want, (padded, want)
    assert {(3, 4), (2, 4), (1, 1)} <= set(calls), calls


def test_padded_decode_tokens_match_dense_interpreted_on_cpu():
    code = "from tests.worker.test_cuda_graph_padding import run_interpreted; run_interpreted()"
    run_in_interpreter(code, timeout=600)
