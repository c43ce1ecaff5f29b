"""A model with alternating sliding-window and full-attention layers through the real
engine (ModelRunner -> KV cache groups -> scheduler): the sliding group runs from a pool
far smaller than full attention would need, freeing out-of-window blocks, while the full
group keeps every block; greedy tokens equal a dense (unpaged) reference's, also with
several sequences batched and prefill chunks smaller than the prompts."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cvllm import loader
from cvllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from cvllm.core.block_manager import PLACEHOLDER_BLOCK
from cvllm.engine.llm import LLM
from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine.tokenizer import Tokenizer
from cvllm.layers.attention import Attention
from cvllm.sampling_params import SamplingParams
from cvllm.worker import model_runner as mr
from cvllm.worker import runner_setup as rs

VOCAB, HIDDEN, H, HKV, D = 256, 32, 4, 2, 8
WINDOWS = (6, None, 6)
BS = 8
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [7, 7, 1, 200, 45, 13, 8, 91, 120, 64, 5, 19, 23, 150, 77],
           [100, 2, 33, 44, 55, 66, 77, 88, 99, 110, 121]]
NEW = 50


class MixedModel(nn.Module):
    """Embedding, then per layer x += o(attention(qkv(x))) with the layer's window; no
    cache_specs(), so the worker derives the specs from the Attention modules."""

    def __init__(self, model_config, quant_config=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, (H + 2 * HKV) * D) for _ in WINDOWS)
        self.o = nn.ModuleList(nn.Linear(H * D, HIDDEN) for _ in WINDOWS)
        self.attn = nn.ModuleList(Attention(H, D, D**-0.5, HKV, sliding_window=w) for w in WINDOWS)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def init_dummy_weights(self, seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)

    def _qkv(self, i, x):
        return self.qkv[i](x).split([H * D, HKV * D, HKV * D], dim=-1)

    def forward(self, input_ids, positions, attn_metadata, kv_caches):
        x = self.embed(input_ids)  # [T, hidden]
        for i in range(len(WINDOWS)):
            q, k, v = self._qkv(i, x)
            x = x + self.o[i](self.attn[i](q, k, v, kv_caches[i], attn_metadata))
        return x

    def compute_logits(self, hidden):
        return self.head(hidden).float()

    @torch.no_grad()
    def dense_logits(self, ids):
        """Unpaged reference: every layer attends with an explicit causal (+window) mask."""
        x = self.embed(torch.tensor(ids))  # [L, hidden]
        L = len(ids)
        pos = torch.arange(L)
        for i, w in enumerate(WINDOWS):
            q, k, v = (t.view(L, -1, D).transpose(0, 1) for t in self._qkv(i, x))  # [heads, L, D]
            mask = pos[None, :] <= pos[:, None]
            if w:
                mask &= pos[None, :] > pos[:, None] - w
            k, v = (t.repeat_interleave(H // HKV, dim=0) for t in (k, v))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)
            x = x + self.o[i](o.transpose(0, 1).reshape(L, H * D))
        return self.compute_logits(x)


def _dense_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.dense_logits(ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(loader.load_tokenizer(loader.resolve_model_source()))


def _llm(monkeypatch, tokenizer, num_blocks, chunk):
    monkeypatch.setattr(rs, "get_model_class", lambda arch: MixedModel)
    hf = dict(hidden_size=HIDDEN, num_hidden_layers=len(WINDOWS), num_attention_heads=H,
              num_key_value_heads=HKV, vocab_size=VOCAB, max_position_embeddings=96)
    config = EngineConfig(
        model=ModelConfig("MixedForTest", hf), device=DeviceConfig(), load_format="dummy",
        cache=CacheConfig(block_size=BS, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=3, prefill_chunk_size=chunk),
    )
    return LLM.from_engine(LLMEngine(config, tokenizer, mr.ModelRunner(config, source=None)))


def test_mixed_layers_free_only_the_sliding_group(monkeypatch, tokenizer):
    llm = _llm(monkeypatch, tokenizer, num_blocks=30, chunk=8)
    engine = llm.engine
    full, sliding = engine.kv_cache_manager.groups
    assert engine.kv_layout.windows == [None, 6]
    assert [g.layer_ids for g in engine.kv_layout.groups] == [(1,), (0, 2)]
    # Full attention needs 9 blocks per sequence at the end, 27 in all; the sliding pool
    # is capped at 3 x (ceil(5/8) + 2) + ceil(8/8) = 10.
    assert full.num_total_blocks == 30 and sliding.num_total_blocks == 10
    original_step = engine.step

    def step():
        outs = original_step()
        for seq in engine.scheduler.running:
            assert full.num_live_blocks(seq) * BS >= seq.num_computed_tokens
            assert PLACEHOLDER_BLOCK not in seq.group_block_ids(0)
            assert sliding.num_live_blocks(seq) <= math.ceil(6 / BS) + 1
        return outs

    engine.step = step
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    got = [r.token_ids for r in llm.generate(PROMPTS, params)]
    model = engine.runner.model
    assert got == [_dense_greedy(model, p, NEW) for p in PROMPTS]
    assert full.num_free_blocks == 30 and sliding.num_free_blocks == 10


def test_batched_prefill_logits_match_dense(monkeypatch, tokenizer):
    llm = _llm(monkeypatch, tokenizer, num_blocks=30, chunk=64)
    model, seen = llm.engine.runner.model, []
    original = model.compute_logits
    model.compute_logits = lambda h: seen.append(original(h)) or seen[-1]
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1))
    assert len(seen) == 1 and seen[0].shape == (3, VOCAB)
    for row, p in zip(seen[0], PROMPTS):
        torch.testing.assert_close(row, model.dense_logits(p)[-1], rtol=1e-4, atol=1e-4)
