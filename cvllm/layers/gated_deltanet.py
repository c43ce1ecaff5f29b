"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the per-sequence state, its
math over a mixed batch, and the ``GatedDeltaNet`` mixer core.

Built by the hybrid model classes, one ``GatedDeltaNet`` per linear-attention layer on
every rank, holding this rank's heads (TP splits the key heads; each key head keeps its
group of ``Hv/Hk`` value heads). The model owns the input projections and ``out_proj``
(their layouts differ between Qwen3-Next and Qwen3.5) and hands the core the projected
``mixed_qkv``, ``z``, ``b``, ``a``. The core owns the conv weight, ``A_log``, ``dt_bias``
and the output gated RMSNorm.

State: each running sequence owns one slot of the layer's ``(conv_states [S, C, K-1],
ssm_states [S, Hv, Dk, Dv])`` (allocated by the worker from ``state_spec()``, assigned
by the scheduler, addressed by ``attn_metadata.state_slots``). A sequence's first chunk
(``has_initial_state`` False) starts from zeros; every later step, decode or chunked
prefill, continues from the slot and writes it back. The recurrent state is float32
(as transformers keeps it): the delta rule accumulates over the whole sequence.

Math: a depthwise causal conv1d continuing from the conv state (vectorised over the
batch), then the gated delta rule -- a one-step recurrence for the decode rows, the
chunked (WY / UT-transform) form for each prefill row -- then ``RMSNormGated``.
The plain per-sequence references live in ``kernels/reference/deltanet.py``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.attention.specs import StateSpec
from cvllm.distributed import parallel_state
from cvllm.kernels.reference.deltanet import l2norm_ref
from cvllm.layers.layernorm import ScaledNorm
from cvllm.layers.utils import as_tensor, copy_checked, divide, split_sizes
from cvllm.quantization.base import frozen_param

LinearAttnState = Tuple[torch.Tensor, torch.Tensor]
"""One linear-attention layer's ``(conv_states [S, C, K-1], ssm_states [S, Hv, Dk, Dv])``."""

CHUNK_SIZE = 64
"""Tokens per chunk of the chunked delta rule (transformers' and FLA's default)."""


# ----------------------------------------------------------------- causal conv1d
def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Depthwise causal conv over a batch of sequences, each continuing from its slot.

    ``x [T, C]`` (sequence ``b`` owns rows ``query_start_loc[b]:query_start_loc[b+1]``),
    ``weight [C, K]``, ``conv_states [S, C, K-1]`` (updated in place for the batch's slots)
    -> ``[T, C]``. Each sequence's K-1 previous inputs are laid in front of its tokens in
    one buffer, so every output is one K-wide window of that buffer: no loop over sequences.
    """
    num_tokens, channels = x.shape
    width = weight.shape[1]
    hist = width - 1
    num_seqs = state_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return x.new_zeros(num_tokens, channels)
    dev = x.device
    qsl = query_start_loc.to(device=dev, dtype=torch.int64)  # [B+1]
    seq_ids = torch.arange(num_seqs, device=dev)  # [B]
    seq_of = torch.repeat_interleave(seq_ids, qsl[1:] - qsl[:-1], output_size=num_tokens)  # [T]
    tok_row = torch.arange(num_tokens, device=dev) + (seq_of + 1) * hist  # [T] row in ext
    taps = torch.arange(hist, device=dev)  # [K-1]
    head_rows = (qsl[:-1] + seq_ids * hist)[:, None] + taps  # [B, K-1] history rows
    tail_rows = (qsl[1:] + (seq_ids + 1) * hist - hist)[:, None] + taps  # [B, K-1] new state

    prev = conv_states[state_slots]  # [B, C, K-1]
    prev = torch.where(has_initial_state.to(dev)[:, None, None], prev, torch.zeros_like(prev))
    ext = x.new_empty(num_tokens + num_seqs * hist, channels)  # [T + B(K-1), C]
    ext[head_rows.reshape(-1)] = prev.transpose(1, 2).reshape(-1, channels).to(x.dtype)
    ext[tok_row] = x
    out = torch.zeros(num_tokens, channels, dtype=torch.float32, device=dev)  # [T, C]
    for tap in range(width):  # a loop over the K taps, not a [T, K, C] window tensor
        out += ext[tok_row - hist + tap].float() * weight[:, tap].float()
    if bias is not None:
        out = out + bias.float()
    conv_states[state_slots] = ext[tail_rows].transpose(1, 2).to(conv_states.dtype)
    return _activate(out, activation).to(x.dtype)


def _activate(x: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(x)
    if activation is None:
        return x
    raise ValueError(f"unsupported conv activation {activation!r}; supported: silu, swish")


# ----------------------------------------------------------------- gated delta rule
def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``q``/``k [.., Hk, Dk]`` -> float32 ``[.., Hv, Dk]``: each key head repeated for its
    ``Hv/Hk`` value heads, L2-normalised, and q scaled by ``Dk^-1/2``."""
    rep = num_v_heads // k.shape[-2]
    q, k = (t.float().repeat_interleave(rep, dim=-2) for t in (q, k))
    return l2norm_ref(q) * q.shape[-1] ** -0.5, l2norm_ref(k)


def recurrent_gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences (float32, q/k from ``prepare_qk``): ``q``/``k
    [B, H, Dk]``, ``v [B, H, Dv]``, ``g``/``beta [B, H]``, ``state [B, H, Dk, Dv]`` ->
    ``(out [B, H, Dv], new state)``."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)  # [B, H, Dv]
    delta = (v - predicted) * beta[..., None]  # [B, H, Dv]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk_size: int = CHUNK_SIZE,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of one sequence, a chunk of tokens at a time (float32, q/k
    from ``prepare_qk``): ``q``/``k [L, H, Dk]``, ``v [L, H, Dv]``, ``g``/``beta [L, H]``,
    ``state [H, Dk, Dv]`` -> ``(out [L, H, Dv], final state)``.

    Within a chunk, with ``c_i`` the cumulative log decay and ``S`` the state entering it,
    the values written ``u`` solve ``(I + A) u = beta*v - beta*exp(c)*k S`` where
    ``A_ij = beta_i exp(c_i - c_j) k_i.k_j`` (j < i); then ``o_i = exp(c_i) q_i S +
    sum_{j<=i} exp(c_i - c_j) (q_i.k_j) u_j`` and ``S' = exp(c_last) S + sum_j
    exp(c_last - c_j) k_j u_j^T``. Both triangular solves run for all chunks at once;
    only the state hand-off loops. Padding tokens have ``beta = 0, g = 0``: no effect.
    """
    length, heads, _ = k.shape
    pad = (-length) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v))  # [H, L', D]
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(0, 1) for t in (g, beta))  # [H, L']
    n = (length + pad) // chunk_size
    q, k, v = (t.reshape(heads, n, chunk_size, -1) for t in (q, k, v))  # [H, N, C, D]
    g, beta = (t.reshape(heads, n, chunk_size) for t in (g, beta))  # [H, N, C]
    cum = g.cumsum(-1)  # [H, N, C]
    incl = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~incl, float("-inf")).exp()
    a = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # [H, N, C, C]
    # u = w_v - w_k @ S: the S-independent parts of the solve, for every chunk at once.
    w_v = torch.linalg.solve_triangular(a, beta[..., None] * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(
        a, (beta * cum.exp())[..., None] * k, upper=False, unitriangular=True
    )  # [H, N, C, Dk]
    attn = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C]
    q_decayed = q * cum.exp()[..., None]  # [H, N, C, Dk]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # [H, N, C, Dk]
    out = torch.empty_like(v)  # [H, N, C, Dv]
    for i in range(n):
        u = w_v[:, i] - w_k[:, i] @ state  # [H, C, Dv]
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ u
        state = state * cum[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.reshape(heads, n * chunk_size, -1)[:, :length].transpose(0, 1)  # [L, H, Dv]
    return out, state


def gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ssm_states: torch.Tensor, attn_metadata,
) -> torch.Tensor:
    """The gated delta rule over the step's batch: ``q``/``k [T, Hk, Dk]``, ``v [T, Hv, Dv]``,
    ``g``/``beta [T, Hv]`` -> float32 ``[T, Hv, Dv]``; reads and writes each sequence's slot
    of ``ssm_states [S, Hv, Dk, Dv]``. The leading decode rows take one batched recurrent
    step; each prefill row (a whole prompt or a chunk of one) the chunked form."""
    slots = attn_metadata.state_slots
    has_init = attn_metadata.has_initial_state.to(ssm_states.device)
    qsl = attn_metadata.query_start_loc_cpu  # [B+1] host
    num_decodes = attn_metadata.num_decodes
    q, k = prepare_qk(q, k, v.shape[-2])  # [T, Hv, Dk]
    v, g, beta = v.float(), g.float(), beta.float()
    out = v.new_empty(v.shape)  # [T, Hv, Dv]
    if num_decodes:
        d = slice(0, num_decodes)  # decode b owns token b
        init = _initial(ssm_states[slots[d]], has_init[d])  # [Bd, Hv, Dk, Dv]
        out[d], final = recurrent_gated_delta_rule_step(q[d], k[d], v[d], g[d], beta[d], init)
        ssm_states[slots[d]] = final.to(ssm_states.dtype)
    for b in range(num_decodes, len(qsl) - 1):
        s, e = int(qsl[b]), int(qsl[b + 1])
        if e == s:
            continue
        init = _initial(ssm_states[slots[b]], has_init[b])  # [Hv, Dk, Dv]
        out[s:e], final = chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
        ssm_states[slots[b]] = final.to(ssm_states.dtype)
    return out


def _initial(state: torch.Tensor, has_initial: torch.Tensor) -> torch.Tensor:
    """The slot's state, or zeros for a sequence's first chunk (a reused slot holds the
    previous owner's state). No host sync: a ``where`` on the device."""
    has_initial = has_initial.reshape(has_initial.shape + (1,) * (state.dim() - has_initial.dim()))
    return torch.where(has_initial, state.float(), torch.zeros((), device=state.device))


# ----------------------------------------------------------------- modules
class RMSNormGated(ScaledNorm):
    """``weight * rmsnorm(x) * silu(gate)`` per head (norm before gate); replicated."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        normed = (xf * inv_rms).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class GatedDeltaNet(nn.Module):
    """The conv + gated delta rule + gated norm of one linear-attention layer (this rank's
    heads); a model subclasses it with its projections (so parameter names stay HF's:
    ``conv1d.weight``, ``A_log``, ``dt_bias``, ``norm.weight``). ``forward_core`` input:
    ``mixed_qkv [T, 2*Hk*Dk + Hv*Dv]`` (all q, then k, then v channels), ``z [T, Hv*Dv]``,
    ``b``/``a [T, Hv]``; output ``[T, Hv*Dv]`` for the model's out_proj."""

    def __init__(
        self,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        rms_norm_eps: float,
        activation: str = "silu",
        params_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} must be a multiple of "
                             f"linear_num_key_heads {num_k_heads}")
        self.num_k_heads = divide(num_k_heads, self.tp_size)
        self.num_v_heads = divide(num_v_heads, self.tp_size)
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim = self.num_k_heads * head_k_dim  # this rank's
        self.value_dim = self.num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.activation = activation
        dtype = params_dtype or torch.get_default_dtype()
        # A bare container so the weight keeps its checkpoint name ``conv1d.weight``.
        self.conv1d = nn.Module()
        self.conv1d.weight = frozen_param(
            torch.empty(self.conv_dim, conv_kernel_size, dtype=dtype),  # [C, K]
            weight_loader=self._load_conv)
        self.A_log = frozen_param(torch.empty(self.num_v_heads, dtype=dtype),
                                  weight_loader=self._load_heads)
        self.dt_bias = frozen_param(torch.empty(self.num_v_heads, dtype=dtype),
                                    weight_loader=self._load_heads)
        self.norm = RMSNormGated(head_v_dim, rms_norm_eps, dtype)

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        """Per-sequence state of this layer: conv inputs in the model dtype, the delta-rule
        state in float32."""
        return StateSpec(
            shapes=((self.conv_dim, self.conv_kernel_size - 1),
                    (self.num_v_heads, self.head_k_dim, self.head_v_dim)),
            dtypes=(dtype, torch.float32),
        )

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Checkpoint ``conv1d.weight [2*key_dim + value_dim, 1, K]`` -> this rank's q, k
        and v channels."""
        parts = split_sizes(loaded, [self.key_dim * self.tp_size] * 2
                            + [self.value_dim * self.tp_size], 0)
        # Narrow to this rank's channels before reading (lazy tensors read only them).
        local = [as_tensor(p.narrow(0, self.tp_rank * (p.shape[0] // self.tp_size),
                                    p.shape[0] // self.tp_size)) for p in parts]
        copy_checked(param.data, torch.cat([t.reshape(t.shape[0], -1) for t in local]))

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_v_heads * self.tp_size:
            raise ValueError(f"shape mismatch: per-head tensor {tuple(loaded.shape)} needs "
                             f"{self.num_v_heads * self.tp_size} value heads")
        start = self.tp_rank * self.num_v_heads
        copy_checked(param.data, loaded.narrow(0, start, self.num_v_heads))

    def forward_core(
        self, mixed_qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
        state: LinearAttnState, attn_metadata,
    ) -> torch.Tensor:
        """The model's ``forward`` (its projections) calls this with the projected inputs."""
        conv_states, ssm_states = state
        n = attn_metadata.num_tokens  # rows past it are padding
        out = z.new_zeros(z.shape[0], self.value_dim)  # [T, Hv*Dv]
        if n == 0:
            return out
        mixed = causal_conv1d_varlen(
            mixed_qkv[:n], self.conv1d.weight, None, conv_states, attn_metadata.query_start_loc,
            attn_metadata.state_slots, attn_metadata.has_initial_state, self.activation,
        )  # [n, C]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(n, self.num_k_heads, self.head_k_dim)  # [n, Hk, Dk]
        k = k.reshape(n, self.num_k_heads, self.head_k_dim)
        v = v.reshape(n, self.num_v_heads, self.head_v_dim)  # [n, Hv, Dv]
        beta = b[:n].sigmoid()  # [n, Hv]
        # log decay per token and head, in float32 (exp(A_log) overflows half precision)
        g = -self.A_log.float().exp() * F.softplus(a[:n].float() + self.dt_bias)  # [n, Hv]
        core = gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, attn_metadata)  # [n, Hv, Dv]
        core = self.norm(core.to(z.dtype), z[:n].reshape(n, self.num_v_heads, self.head_v_dim))
        out[:n] = core.reshape(n, self.value_dim)
        return out
