"""ModelRunner: owns the model, its KV cache and the sampler on one rank.

Built once per rank by the engine builder (rank 0) or the worker loop (other ranks). At
start-up (the steps are ``worker/runner_setup.py``'s) it loads the model, asks it for its
per-layer ``cache_specs()`` (``attention/specs.py``), sizes them into a ``KVCacheLayout``
(KV cache groups + state slots; rank 0's engine builds its block managers from
``kv_layout``) and allocates ``kv_caches[i]`` per layer.
Each step it receives a ``StepInput`` (flat arrays), copies it to the device, builds the
``AttentionMetadata`` (one view per KV group), zeroes the state slots of sequences that
start afresh, runs the forward and, on rank 0, samples the next tokens.

On CUDA: the KV cache gets ``--gpu-memory-fraction`` of what is left after profiling the
largest step (``worker/memory.py``) unless ``--mem`` sizes it; attention layers run the
Triton backend (``ModelConfig.attention_backend``, resolved by ``EngineConfig``, which
the model constructor hands to its layers); pure-decode steps that fit a capture size
run padded through ``worker/cuda_graph.py`` (graphs captured right after the KV cache is
allocated, replayed unless ``--disable-cuda-graph``), and steps with prompt tokens of up
to ``--cuda-graph-max-tokens`` tokens run padded through ``worker/mixed_graph.py``
(graphs captured piece by piece around the attention); rank 0 brings the sampled ids back
with one device-to-host copy per step (``worker/output_copy.py``).
"""

from __future__ import annotations

import logging
from typing import List, Optional, Union

import numpy as np
import torch

from cvllm.attention.kv_cache import (
    LayerCache,
    allocate_kv_caches,
    fp8_kv_specs,
    kv_caches_nbytes,
    reset_kv_scales,
)
from cvllm.attention.metadata import AttentionMetadata
from cvllm.attention.specs import LayerCacheSpec, StateSpec
from cvllm.config import EngineConfig
from cvllm.core.kv_cache_manager import KVCacheLayout
from cvllm.distributed import parallel_state
from cvllm.core.sampling_batch import SamplingBatch
from cvllm.core.step_input import StepInput
from cvllm.core.wire_format import StepInputError
from cvllm.kernels.transfer import to_device
from cvllm.layers.attention import require_capabilities
from cvllm.layers.layernorm import pair_norm_outputs
from cvllm.layers.sampler import Sampler
from cvllm.layers.sampling_tensors import SamplingTensors
from cvllm.models.flat_decode import build_flat_decoder
from cvllm.worker import memory
from cvllm.worker.cuda_graph import CudaGraphRunner, graph_unsafe_reason, patch_placeholders
from cvllm.worker.mixed_graph import MixedGraphRunner
from cvllm.worker.output_copy import OutputCopy, PendingOutput, StepResult
from cvllm.worker.runner_setup import (init_cuda_graphs, init_mixed_graphs, load_model,
                                       model_cache_specs, size_kv_cache)

__all__ = ["ModelRunner", "PendingStep", "DeferredSampling", "StepResult", "patch_placeholders"]

logger = logging.getLogger("cvllm.worker")

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


class ModelRunner:
    def __init__(self, config: EngineConfig, source, rank: int = 0):
        self.config = config
        self.rank = rank
        dev = config.device
        self.device = torch.device(dev.device, dev.device_ids[0]) if dev.device == "cuda" else torch.device("cpu")
        self.dtype = TORCH_DTYPES[config.model.dtype]
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # events and graphs use the current device
        self.model = load_model(config, source, self.device, self.dtype)
        if self.device.type == "cuda":
            paired = pair_norm_outputs(self.model)  # before any forward is captured
            if paired:
                logger.info("%d RMSNorms write the int8 input of the GGUF GEMV after them",
                            paired)
        self.cache_specs: List[LayerCacheSpec] = model_cache_specs(self.model, config, self.dtype)
        if config.cache.fp8_kvcache:  # halves bytes per block: sizing and allocation see it
            require_capabilities(self.model, "fp8_cache")
            self.cache_specs = fp8_kv_specs(self.cache_specs)
        graph_unsafe = (graph_unsafe_reason(self.model, self.cache_specs)
                        if self.device.type == "cuda" else "not on CUDA")
        self._init_kv_cache(capture=graph_unsafe is None and not config.disable_cuda_graph)
        self._init_step_paths(graph_unsafe)
        if self.device.type == "cuda":
            secs = memory.warm_up_prefill(self.model, self.cache_specs,
                                          config.cache.block_size, self.device,
                                          max_model_len=config.model.max_model_len)
            logger.info("prefill kernels warmed up in %.1f s", secs)
        reset_kv_scales(self.kv_caches)  # FP8: the first real prefill calibrates, not warm-up
        # Rows without a seed of their own draw from this generator: the same --seed, the
        # same requests, the same tokens (as vLLM's seed), run after run.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.output_copy = OutputCopy(self.device)
        self._prev_sampled: Optional[torch.Tensor] = None
        """The last launched step's sampled ids ([S] int64, device), for placeholders."""

    # ---------------------------------------------------------------- set-up
    def _init_kv_cache(self, capture: bool) -> None:
        """Size the KV cache (``capture``: keep room for the CUDA graph pool) and allocate
        it, one ``LayerCache`` per layer."""
        self.kv_layout: KVCacheLayout = size_kv_cache(self.config, self.model, self.cache_specs,
                                                      self.device, capture)
        self.num_blocks = self.kv_layout.groups[0].num_blocks
        """Blocks of KV group 0 (the only group of most models)."""
        self.config.cache.num_blocks = self.num_blocks
        self.kv_caches: List[LayerCache] = allocate_kv_caches(
            self.cache_specs, self.kv_layout, self.device
        )
        self._state_layers = [i for i, s in enumerate(self.cache_specs) if isinstance(s, StateSpec)]
        groups = ", ".join(
            f"window {g.sliding_window}: {len(g.layer_ids)} layers x {g.num_blocks} blocks"
            for g in self.kv_layout.groups
        )
        logger.info("KV cache: %.1f MB; groups %s; %d state slots",
                    kv_caches_nbytes(self.kv_caches) / 2**20, groups,
                    self.kv_layout.num_state_slots)

    def _init_step_paths(self, graph_unsafe: Optional[str]) -> None:
        """The paths a step may take besides the model's own forward (``graph_unsafe``: why
        decode graphs cannot be captured, None when they can)."""
        config = self.config
        self.graphs: Optional[CudaGraphRunner] = init_cuda_graphs(
            config, self.model, self.kv_caches, self.kv_layout, self.device, graph_unsafe)
        """Padded pure-decode steps (CUDA, graph-safe models only); None: all eager."""
        self.flat = (build_flat_decoder(self.model)
                     if self.device.type == "cpu" and not config.disable_cuda_graph else None)
        """The model's flat decode loop for pure-decode CPU steps (``models/flat_decode.py``);
        None: every step runs the model's forward."""
        self.mixed: Optional[MixedGraphRunner] = init_mixed_graphs(
            config, self.model, self.kv_caches, self.kv_layout, self.device, self.graphs)
        """Padded steps with prompt tokens (same conditions, and --cuda-graph-max-tokens)."""

    # ---------------------------------------------------------------- step
    def execute(self, step: StepInput, sampling: Optional[SamplingBatch] = None
                ) -> Optional[StepResult]:
        """Run one step and wait for its sampled ids. ``sampling`` (rank 0 only): the
        sampling rows' inputs beside the wire format (penalty histories, logprob counts,
        the structured-output bitmask); other ranks pass None and get None."""
        return self.launch(step, sampling).result()

    deferred_sampling = True
    """``launch(..., defer_sampling=True)`` is supported (rank 0's engine fills a
    structured-output bitmask while the forward runs)."""

    @torch.inference_mode()
    def launch(self, step: StepInput, sampling: Optional[SamplingBatch] = None,
               defer_sampling: bool = False) -> Union["PendingStep", "DeferredSampling"]:
        """Launch one step with no host sync; ``.result()`` waits for its sampled ids.
        Placeholder input ids (``step.prev_rows``) take the ids the previous launched
        step sampled, on the device, so the host may launch step N+1 before it has
        seen N's tokens (the overlapped engine loop). ``defer_sampling`` (rank 0): launch
        the forward and the LM head only and return a ``DeferredSampling`` (why: there)."""
        self._check_step(step)
        if step.block_copies.size:
            self._copy_blocks(step.block_copies)
        prev = None
        max_row = int(step.prev_rows.max()) if step.prev_rows.size else -1
        if max_row >= 0:  # placeholders: the previous step's sampled ids fill them in
            prev = self._prev_sampled
            if prev is None or max_row >= prev.shape[0]:
                raise StepInputError(f"step {step.step_id} patches ids the previous step "
                                     "did not sample")
        bs = self.graphs.padded_size(step) if self.graphs is not None else None
        tokens = self.mixed.padded_size(step) if bs is None and self.mixed is not None else None
        S = len(step.logits_indices)
        stats = inputs = None
        if bs is not None:  # every row samples; the LM head and row_stats ran in the graph
            logits = self.graphs.run(step, bs, prev)[:S]  # [S, V] float32
            stats, inputs = self.graphs.stats(S), self.graphs.buffers.input_ids[:bs]
        elif tokens is not None:  # [tokens, hidden]: rows past the step's are padding
            hidden = self.mixed.run(step, tokens, self._build_metadata(step), prev)
        else:
            hidden = self._forward_eager(step, prev)  # [T, hidden]
        self._prev_sampled = None
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if S == 0 or (sampling is None and tp_size == 1):
            return PendingStep(None)
        if bs is None:  # every rank runs the LM head: its vocabulary shards meet in an all-gather
            logits = self.model.compute_logits(self._sampling_rows(hidden, step))  # [S, V] float32
        if sampling is None:  # ranks != 0: only rank 0 samples; its ids come by broadcast
            self._prev_sampled = self._receive_sampled(len(step.logits_indices))
            return PendingStep(None)
        if defer_sampling:
            return DeferredSampling(self, logits, step, sampling, prev, stats, inputs)
        return self._sample(logits, step, sampling, prev, stats, inputs)

    def _receive_sampled(self, S: int) -> torch.Tensor:
        """Rank 0's sampled ids of this step ([S] int64, device), for the next step's
        placeholders (tensor parallelism only)."""
        from cvllm.distributed import comm

        ids = torch.empty(S, dtype=torch.int64, device=self.device)
        return comm.tensor_model_parallel_broadcast(ids, src=0)

    def _forward_eager(self, step: StepInput, prev: Optional[torch.Tensor] = None) -> torch.Tensor:
        dev = self.device
        input_ids = to_device(step.input_ids, dev, torch.int64)  # [T]
        if prev is not None:
            prev_rows = to_device(step.prev_rows, dev, torch.int64)  # [T]
            input_ids = patch_placeholders(input_ids, prev_rows, prev)
        positions = to_device(step.positions, dev, torch.int64)  # [T]
        meta = self._build_metadata(step)
        self._reset_fresh_state_slots(meta)
        if self.flat is not None and meta.num_decodes == meta.num_seqs == input_ids.shape[0]:
            return self.flat(input_ids, positions, meta, self.kv_caches)  # [T, hidden]
        return self.model(input_ids, positions, meta, self.kv_caches)  # [T, hidden]

    def _sampling_rows(self, hidden: torch.Tensor, step: StepInput) -> torch.Tensor:
        """``hidden``'s rows at ``logits_indices`` -> ``[S, hidden]``; a leading run of
        rows (every decode step) is a view, with no index copy to the device."""
        idx = step.logits_indices
        S = int(idx.shape[0])
        if np.array_equal(idx, np.arange(S)):
            return hidden[:S]
        return hidden[to_device(idx, self.device, torch.int64)]

    def _check_step(self, step: StepInput) -> None:
        """The step's KV group windows must be this runner's own, its state slots and
        copied blocks in range."""
        windows = [int(w) or None for w in step.kv_group_windows.tolist()]
        if windows != self.kv_layout.windows:
            raise StepInputError(
                f"step {step.step_id} has KV groups {windows}, this cache has "
                f"{self.kv_layout.windows}"
            )
        step.validate_copies(self.kv_layout.groups[0].num_blocks)
        if self._state_layers:
            slots = step.state_slots
            if slots.size and (slots.min() < 0 or slots.max() >= self.kv_layout.num_state_slots):
                raise StepInputError(f"step {step.step_id} has a state slot out of range")

    def _build_metadata(self, step: StepInput) -> AttentionMetadata:
        """One view per KV group (``_check_step`` has checked the windows)."""
        windows = [int(w) or None for w in step.kv_group_windows.tolist()]
        return AttentionMetadata.build(
            slot_mapping=step.slot_mapping, query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens, block_tables=step.block_tables, device=self.device,
            sliding_window=windows[0],
            extra_groups=[step.kv_group(g) for g in range(1, step.num_kv_groups)],
            state_slots=step.state_slots,
        )

    def _copy_blocks(self, copies) -> None:
        """``copies [C, 2]`` (src, dst) block ids of KV group 0: every layer of the group
        copies its cache blocks (K and V, MLA's latent cache; FP8 as bytes), before
        anything of the step writes a block."""
        pairs = to_device(copies, self.device, torch.int64)  # [C, 2]
        src, dst = pairs[:, 0], pairs[:, 1]
        for i in self.kv_layout.groups[0].layer_ids:
            for t in self.kv_caches[i]:
                if t is None:
                    continue
                raw = t.view(torch.uint8) if t.element_size() == 1 else t  # no float8 index ops
                raw.index_copy_(0, dst, raw.index_select(0, src))

    def _reset_fresh_state_slots(self, meta: AttentionMetadata) -> None:
        """Zero the state of sequences with no computed tokens (new, or recomputing after
        preemption), so a slot never leaks a previous owner's state."""
        if not self._state_layers or meta.num_seqs == 0:
            return
        fresh = meta.state_slots[~meta.has_initial_state]  # [F] int64
        if fresh.numel() == 0:
            return
        for i in self._state_layers:
            for t in self.kv_caches[i]:
                t.index_fill_(0, fresh, 0)

    def _sample(self, logits: torch.Tensor, step: StepInput, sampling: SamplingBatch,
                prev: Optional[torch.Tensor] = None, stats: Optional[tuple] = None,
                inputs: Optional[torch.Tensor] = None) -> "PendingStep":
        """``stats``: the graph's ``row_stats`` of ``logits``; ``inputs``: the padded
        step's input ids, placeholders patched (the graph overwrote ``prev`` with this
        step's greedy ids)."""
        if sampling.num_rows != logits.shape[0]:
            raise StepInputError(f"step {step.step_id} samples {logits.shape[0]} rows, its "
                                 f"sampling batch has {sampling.num_rows}")
        tensors = SamplingTensors.from_lists(
            temperature=step.temperature.tolist(), top_p=step.top_p.tolist(), top_k=step.top_k.tolist(),
            min_p=step.min_p.tolist(), presence_penalty=step.presence_penalty.tolist(),
            frequency_penalty=step.frequency_penalty.tolist(),
            repetition_penalty=step.repetition_penalty.tolist(),
            seeds=[int(s) if h else None for s, h in zip(step.seeds.tolist(), step.has_seed.tolist())],
            output_index=step.output_index.tolist(),
            prompt_token_ids=sampling.prompt_token_ids,
            # known ids only: this step's own placeholder (and, in the overlapped loop,
            # the previous step's) are not history yet
            output_token_ids=sampling.output_token_ids,
            vocab_size=logits.shape[-1], device=self.device,
            mask_rows=sampling.mask_rows, bitmask=sampling.bitmask,
        )
        if prev is not None and tensors.output_counts is not None:
            _count_pending_tokens(tensors.output_counts, step, prev, inputs)
        want, num_logprobs = sampling.want_logprobs, sampling.num_logprobs
        out = self.sampler(logits, tensors, num_logprobs=num_logprobs, logprobs=want,
                           stats=stats)
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            from cvllm.distributed import comm  # every rank patches the next placeholders

            comm.tensor_model_parallel_broadcast(out.sampled, src=0)
        self._prev_sampled = out.sampled.reshape(-1)  # [S] int64
        return PendingStep(self.output_copy.start(out, with_logprobs=want, num_top=num_logprobs))


class DeferredSampling:
    """A launched forward whose sampler is not launched yet (``launch(defer_sampling=True)``,
    rank 0): ``sample()`` launches it later, once the host knows what it needs (the
    structured-output bitmask of rows whose grammar waits for the previous step's token).
    Its logits live in the CUDA graph's output buffer, which the next replay overwrites:
    ``sample`` comes before the next ``launch``."""

    def __init__(self, runner: ModelRunner, logits: torch.Tensor, step: StepInput,
                 sampling: SamplingBatch, prev: Optional[torch.Tensor],
                 stats: Optional[tuple] = None, inputs: Optional[torch.Tensor] = None):
        self._args = (logits, step, sampling, prev, stats, inputs)
        self._runner = runner
        self.sampling = sampling
        """Its ``set_bitmask`` may be called until ``sample``."""

    @torch.inference_mode()
    def sample(self) -> "PendingStep":
        if self._args is None:
            raise RuntimeError("this step was sampled already")
        args, self._args = self._args, None
        return self._runner._sample(*args)


class PendingStep:
    """A launched step; ``result()`` waits for its sampled ids (None: nothing sampled
    here -- a step of prefill chunks only, or a rank other than 0)."""

    def __init__(self, output: Optional[PendingOutput]):
        self._output = output

    def result(self) -> Optional[StepResult]:
        return self._output.wait() if self._output is not None else None


def _count_pending_tokens(output_counts: torch.Tensor, step: StepInput,
                          prev: torch.Tensor, inputs: Optional[torch.Tensor] = None) -> None:
    """Penalties in the overlapped loop: a row whose input token is the previous step's
    placeholder has that token in its history too, but only on the device; add it to the
    row's counts (``output_counts [S, V]``, built from the known ids) without a sync.
    The ids come from ``prev`` at the placeholder rows or, given ``inputs`` (the step's
    patched input ids), from the sampling rows' own tokens."""
    rows = step.prev_rows[step.logits_indices]  # [S]: the previous step's row, or -1
    which = np.nonzero(rows >= 0)[0]
    if which.size == 0:
        return
    dev = output_counts.device
    if inputs is not None:
        ids = inputs[to_device(step.logits_indices[which], dev, torch.int64)]  # [P]
    else:
        ids = prev[to_device(rows[which], dev, torch.int64)]  # [P]
    at = to_device(which, dev, torch.int64)  # [P]
    output_counts.index_put_((at, ids), torch.ones_like(ids, dtype=output_counts.dtype),
                             accumulate=True)
