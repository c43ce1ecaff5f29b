"""Configuration dataclasses, built once from the CLI in ``cli.py`` and passed explicitly.

Every config validates itself in ``__post_init__`` and raises ``ConfigError`` with a
message a user can act on. ``ModelConfig`` is built by ``loader/`` from config.json or GGUF
metadata; the others come from command-line flags. All ranks hold identical copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and why."""


DTYPES = ("bf16", "f16", "f32")
ATTENTION_BACKENDS = ("auto", "triton", "torch_ref")


def resolve_attention_backend(name: str, device: str) -> str:
    """``auto`` -> ``triton`` on a ``cuda`` device, ``torch_ref`` elsewhere; any other
    name as it is."""
    if name != "auto":
        return name
    return "triton" if device == "cuda" else "torch_ref"


@dataclass
class ModelConfig:
    architecture: str
    """HF architecture name, e.g. ``LlamaForCausalLM``; picks the model class."""
    hf_config: Dict[str, Any]
    """The model's config.json (or its equivalent built from GGUF metadata), read by the
    model classes with ``get`` (DESIGN rule 10: read config, never assume)."""
    dtype: str = "f32"
    """Compute dtype: bf16, f16 or f32."""
    max_model_len: int = 0
    """Longest sequence (prompt + output) served; 0 means the model's own limit."""
    eos_token_ids: List[int] = field(default_factory=list)
    """Token ids that end generation (from generation_config / tokenizer / GGUF)."""
    bos_token_id: Optional[int] = None
    source: str = ""
    """Where the model came from (a folder or a .gguf path), for logs and /v1/models."""
    attention_backend: str = "auto"
    """The attention backend the model's layers run (``attention/backend.py``), handed by
    the model constructors to every ``Attention``. ``EngineConfig`` sets it, resolved
    (``triton`` or ``torch_ref``); ``auto`` is left only for models built by hand."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention backend must be one of "
                              f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            v = self.hf_config.get(key)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model config field {key!r} must be a positive integer, got {v!r}")
        native = self.native_max_len
        if self.max_model_len <= 0:
            self.max_model_len = native
        if self.max_model_len <= 0:
            raise ConfigError("--max-model-len must be positive")

    def get(self, key: str, default: Any = None) -> Any:
        return self.hf_config.get(key, default)

    @property
    def native_max_len(self) -> int:
        return int(self.hf_config.get("max_position_embeddings") or 2048)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        hd = self.hf_config.get("head_dim")
        return int(hd) if hd else int(self.hf_config["hidden_size"]) // self.num_heads


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per paged KV block."""
    kvcache_mem_mb: Optional[int] = None
    """KV cache size in MB (--mem); overrides gpu_memory_fraction when given."""
    gpu_memory_fraction: float = 0.7
    """Fraction of the memory left after loading weights given to the KV cache."""
    num_blocks: Optional[int] = None
    """Set by the worker once the cache is sized; tests may fix it directly."""
    fp8_kvcache: bool = False
    """--fp8-kvcache: full and sliding attention layers keep K/V in FP8 e4m3 with a
    per-layer scale (``attention/kv_cache.py``), half the bytes of bf16; MLA latents and
    linear-attention states stay in the model dtype."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a prompt prefix computed before (``core/prefix_cache.py``);
    off with --disable-prefix-cache, and always off for models with linear-attention
    state layers."""
    prefix_cache_max_tokens: Optional[int] = None
    """--prefix-cache-max-tokens: most tokens' worth of cached blocks that no sequence
    uses kept per KV group (rounded down to whole blocks); None keeps them until the
    free blocks run out."""

    def __post_init__(self) -> None:
        if self.prefix_cache_max_tokens is not None and self.prefix_cache_max_tokens < 0:
            raise ConfigError(f"--prefix-cache-max-tokens must be >= 0, got "
                              f"{self.prefix_cache_max_tokens}")
        if self.block_size not in (8, 16, 32, 64, 128, 256):
            raise ConfigError(f"--block-size must be one of 8, 16, 32, 64, 128, 256, got {self.block_size}")
        if self.kvcache_mem_mb is not None and self.kvcache_mem_mb <= 0:
            raise ConfigError(f"--mem must be a positive number of MB, got {self.kvcache_mem_mb}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")


DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 128}
"""Step token budget by device when neither --max-num-batched-tokens nor
--prefill-chunk-size is given. CUDA: vLLM's online-serving default. CPU: a step's time
grows about linearly with its tokens (default model on 2 cores: ~1 ms a prompt token,
plus attention over the context, ~0.65 s for a 128-token chunk at 8k tokens of context),
so 128 keeps a decoding stream's gap under 1 s and a new request's first token within
2 s while an 8k-token prompt is prefilled (``tools/bench_fairness.py``)."""


def default_max_num_batched_tokens(device: str) -> int:
    return DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device, DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"])


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most sequences in one step."""
    max_model_len: int = 4096
    """Longest sequence; copied from ModelConfig.max_model_len."""
    prefill_chunk_size: Optional[int] = None
    """Most prompt tokens of one sequence per step, a cap under the step budget (several
    long prompts then share a step); None: no cap but the budget; 0 disables chunking (a
    prompt is computed in one step or waits)."""
    chunk_context_tokens: int = 0
    """Context length at which a prompt token's attention costs about what its matmuls cost
    (``attention_parity_context``); when set, a prompt chunk past it is cut so that its
    whole work fits the step budget (``chunk_cap``). 0: off (chunks follow the token
    budget alone). ``engine/builder.py`` sets it on the CPU."""
    max_num_batched_tokens: int = 0
    """Token budget of one step (--max-num-batched-tokens), shared by the decodes (one
    token each, scheduled first and even past it) and the prefill chunks. 0 derives it:
    max_model_len without chunking, else --prefill-chunk-size, else
    ``DEFAULT_MAX_NUM_BATCHED_TOKENS['cuda']``; never below max_num_seqs.
    ``engine/builder.py`` passes the device's default when no flag sets it."""
    copy_prefix_hits: bool = False
    """A sequence admitted while no other runs takes its prefix hit as copies in fresh
    blocks (consecutive with the rest of its blocks) instead of sharing the cached ones:
    the CPU attention reads a lone sequence's K/V in place only when its block ids are
    consecutive (a gather every layer and step otherwise: 2 ms of a 17 ms step of the
    default model on a 2-vCPU VM). ``engine/builder.py`` sets it on the CPU."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 0:
            raise ConfigError(f"--prefill-chunk-size must be >= 0, got {self.prefill_chunk_size}")
        if self.max_num_batched_tokens < 0:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1 (0: derived), got "
                              f"{self.max_num_batched_tokens}")
        if self.max_num_batched_tokens == 0:
            if self.prefill_chunk_size == 0:
                # No chunking: a whole prompt must fit in one step.
                derived = self.max_model_len
            elif self.prefill_chunk_size is not None:
                derived = self.prefill_chunk_size
            else:
                derived = DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"]
            self.max_num_batched_tokens = max(derived, self.max_num_seqs)

    @property
    def chunk_limit(self) -> int:
        """Most prompt tokens one sequence may take in one step."""
        return self.prefill_chunk_size or self.max_model_len

    def chunk_cap(self, context: int) -> int:
        """Most prompt tokens one sequence with ``context`` tokens computed may take in one
        step: ``chunk_limit``, and, with ``chunk_context_tokens`` (C), the most tokens n
        whose work n * (1 + (context + n / 2) / C) -- matmuls, plus attention over the
        context and the chunk itself -- fits the step budget, never fewer than an eighth
        of it. A stream's gap between tokens then stays about one budget's worth of work
        however long the prompt beside it has grown."""
        limit = self.chunk_limit
        c = self.chunk_context_tokens
        if c <= 0 or self.prefill_chunk_size == 0:
            return limit
        budget = self.max_num_batched_tokens
        a = 1.0 + context / c  # work of a token at this context, in tokens
        n = int(c * (math.sqrt(a * a + 2.0 * budget / c) - a))  # n^2/(2c) + a n = budget
        return max(1, min(limit, max(n, budget // 8)))

    @property
    def max_step_tokens(self) -> int:
        """Most tokens one step can hold: the budget, or one per decode past it."""
        return max(self.max_num_batched_tokens, self.max_num_seqs)


@dataclass
class DeviceConfig:
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    device_ids: List[int] = field(default_factory=lambda: [0])

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if not self.device_ids or any(d < 0 for d in self.device_ids):
            raise ConfigError(f"--device-ids must be non-negative integers, got {self.device_ids}")


def check_cpu_dense_gib(value: Optional[float]) -> None:
    """``--cpu-dense-gb``: GiB of bf16 copies of quantized weights a CPU rank may keep for
    decode batches (``quantization/batch_copies.py``: ``BatchCopyBudget``); None: auto (a quarter
    of the free memory on CPUs with AMX or AVX-512 BF16, else none), 0: never. Checked
    by the loader whatever the weights are (``loader/quant_scheme.py``)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"--cpu-dense-gb must be a number >= 0 (0: no copies), got {value}")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    load_format: str = "auto"
    """``auto`` (real weights) or ``dummy`` (random weights from the config alone)."""
    seed: int = 0
    """Seed of the random weights (dummy) and of requests that give no seed."""
    max_gen_tokens: int = 0
    """Default max_tokens of a request that gives none; 0 derives max_model_len/5
    clamped to [128, 16384]."""
    served_model_name: str = ""
    defaults: Dict[str, Any] = field(default_factory=dict)
    """Server-wide sampling defaults from the CLI (temperature, top_p, ...)."""
    disable_cuda_graph: bool = False
    """Launch every step eagerly on CUDA (``--disable-cuda-graph``). Pure-decode steps are
    still padded to the capture sizes, so outputs do not change (``worker/cuda_graph.py``).
    On the CPU: pure-decode steps run through the model's modules instead of its flat
    decode loop (``models/flat_decode.py``; bit-identical outputs)."""
    cuda_graph_max_tokens: int = 512
    """Steps with prompt tokens of at most this many tokens replay CUDA graphs captured
    piece by piece around the attention (``worker/mixed_graph.py``,
    ``--cuda-graph-max-tokens``); 0: they run eagerly, unpadded."""
    attention_backend: str = "auto"
    """``auto`` (Triton on CUDA, the torch reference on the CPU), ``triton`` or
    ``torch_ref`` (``--attention-backend``; ``attention/backend.py``). Resolved for the
    device into ``model.attention_backend`` here, once."""
    quant: Optional[Any] = None
    """The weights' quantization scheme: the ``quantization.base.QuantizationConfig`` the
    loader chose (``loader/quant_scheme.py``: a GGUF file's tensor types, ``--isq``, a
    checkpoint's ``quantization_config``), handed to the model constructor, whose layers
    ask it for their methods; None: float weights. One model is built from it (it holds
    that model's batch-copy budget). Typed ``Any``: this module stays torch-free."""

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"--attention-backend must be one of "
                              f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        self.model.attention_backend = resolve_attention_backend(self.attention_backend,
                                                                 self.device.device)
        if self.cuda_graph_max_tokens < 0:
            raise ConfigError(f"--cuda-graph-max-tokens must be >= 0, got "
                              f"{self.cuda_graph_max_tokens}")
        if self.max_gen_tokens <= 0:
            self.max_gen_tokens = min(max(self.model.max_model_len // 5, 128), 16384)
        self.scheduler.max_model_len = self.model.max_model_len
        if not self.served_model_name:
            self.served_model_name = "default"
