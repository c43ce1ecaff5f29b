"""ModelRunner: owns the model, its KV cache and the sampler on one rank.

Built once per rank by the engine builder (rank 0) or the worker loop (other ranks). Each
step it receives a ``StepInput`` (flat arrays), copies it to the device, builds the
``AttentionMetadata``, runs the forward and, on rank 0, samples the next tokens.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from cvllm.attention.kv_cache import KVCacheSpec, allocate_kv_cache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ConfigError, EngineConfig
from cvllm.core.step_input import StepInput
from cvllm.layers.sampler import Sampler, SamplingTensors
from cvllm.models.registry import get_model_class

logger = logging.getLogger("cvllm.worker")

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}

# Without --mem the CPU cache takes this fraction of available memory, at most this many
# bytes: a CPU host runs other things, and a few GiB hold thousands of tokens already.
_CPU_KV_CAP_BYTES = 2 << 30


@dataclass
class StepResult:
    """Rank 0's result of one step: one entry per sampling row, on the host."""

    token_ids: np.ndarray  # [S] int64
    logprobs: Optional[np.ndarray] = None  # [S] float32, when any row asked for them
    top_ids: Optional[np.ndarray] = None  # [S, k]
    top_logprobs: Optional[np.ndarray] = None  # [S, k]


class ModelRunner:
    def __init__(self, config: EngineConfig, source, rank: int = 0):
        self.config = config
        self.rank = rank
        dev = config.device
        self.device = torch.device(dev.device, dev.device_ids[0]) if dev.device == "cuda" else torch.device("cpu")
        self.dtype = TORCH_DTYPES[config.model.dtype]
        self.model = self._load_model(source)
        self.kv_spec = KVCacheSpec(
            num_layers=config.model.num_layers, num_kv_heads=config.model.num_kv_heads,
            head_dim=config.model.head_dim, block_size=config.cache.block_size, dtype=self.dtype,
        )
        self.num_blocks = self._decide_num_blocks()
        config.cache.num_blocks = self.num_blocks
        self.kv_caches = allocate_kv_cache(self.kv_spec, self.num_blocks, self.device)
        self.sampler = Sampler()

    # ---------------------------------------------------------------- set-up
    def _load_model(self, source) -> torch.nn.Module:
        from cvllm import loader

        cls = get_model_class(self.config.model.architecture)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.config.model)
        finally:
            torch.set_default_dtype(prev)
        if self.config.load_format == "dummy":
            model.init_dummy_weights(self.config.seed)
        else:
            model.load_weights(loader.iter_weights(source))
        return model.eval()

    def _decide_num_blocks(self) -> int:
        cache = self.config.cache
        per_block = self.kv_spec.bytes_per_block
        if cache.num_blocks:
            n = cache.num_blocks
        elif cache.kvcache_mem_mb:
            n = cache.kvcache_mem_mb * (1 << 20) // per_block
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            n = int(free * cache.gpu_memory_fraction) // per_block
        else:
            import psutil

            avail = psutil.virtual_memory().available
            n = min(int(avail * cache.gpu_memory_fraction), _CPU_KV_CAP_BYTES) // per_block
        need = math.ceil(self.config.model.max_model_len / cache.block_size)
        if n < need:
            raise ConfigError(
                f"the KV cache ({n} blocks of {cache.block_size} tokens, {per_block * n / 2**20:.1f} MB) "
                f"cannot hold one sequence of --max-model-len {self.config.model.max_model_len} "
                f"({need} blocks, {per_block * need / 2**20:.1f} MB): raise --mem / "
                f"--gpu-memory-fraction or lower --max-model-len"
            )
        return int(n)

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def execute(self, step: StepInput, seqs: Optional[Sequence] = None) -> Optional[StepResult]:
        """Run one step. ``seqs`` (rank 0 only) are the sampling rows' sequences, whose
        token histories feed the penalties; other ranks pass None and get None."""
        dev = self.device
        input_ids = torch.from_numpy(step.input_ids.astype(np.int64)).to(dev)  # [T]
        positions = torch.from_numpy(step.positions.astype(np.int64)).to(dev)  # [T]
        meta = AttentionMetadata.build(
            slot_mapping=step.slot_mapping, query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens, block_tables=step.block_tables, device=dev,
        )
        hidden = self.model(input_ids, positions, meta, self.kv_caches)  # [T, hidden]
        if seqs is None or len(step.logits_indices) == 0:
            return None
        idx = torch.from_numpy(step.logits_indices.astype(np.int64)).to(dev)
        logits = self.model.compute_logits(hidden[idx])  # [S, V] float32
        return self._sample(logits, step, seqs)

    def _sample(self, logits: torch.Tensor, step: StepInput, seqs: Sequence) -> StepResult:
        want = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        num_logprobs = max(want) if want else 0
        tensors = SamplingTensors.from_lists(
            temperature=step.temperature.tolist(), top_p=step.top_p.tolist(), top_k=step.top_k.tolist(),
            min_p=step.min_p.tolist(), presence_penalty=step.presence_penalty.tolist(),
            frequency_penalty=step.frequency_penalty.tolist(),
            repetition_penalty=step.repetition_penalty.tolist(),
            seeds=[int(s) if h else None for s, h in zip(step.seeds.tolist(), step.has_seed.tolist())],
            output_index=step.output_index.tolist(),
            prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs],
            vocab_size=logits.shape[-1], device=self.device,
        )
        out = self.sampler(logits, tensors, num_logprobs=num_logprobs)
        res = StepResult(token_ids=out.sampled.cpu().numpy())
        if want:
            res.logprobs = out.logprobs.float().cpu().numpy()
            if num_logprobs > 0 and out.top_logprob_ids is not None:
                res.top_ids = out.top_logprob_ids.cpu().numpy()
                res.top_logprobs = out.top_logprob_values.float().cpu().numpy()
        return res
