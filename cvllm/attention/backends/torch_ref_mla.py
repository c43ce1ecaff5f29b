"""Plain-torch paged multi-head latent attention (DeepSeek V2/V3 MLA) over the compressed
cache: the CPU backend of ``layers/mla.py`` and the reference for any MLA kernel.

Stateless (``interface.MLABackend``, the declared MLA variant of the attention
interface); ``MultiHeadLatentAttention`` (``layers/mla.py``) calls ``forward`` once per
layer per step with that layer's ``kv_cache [num_blocks, block_size, R + P]`` (allocated by
the worker from the model's ``MLASpec``; R = kv_lora_rank, P = qk_rope_head_dim) and the
step's ``AttentionMetadata`` (same ``slot_mapping`` / ``block_tables`` as full attention).

Only the compressed form is ever cached: per token the normalised latent ``c_kv [R]`` and
the rotated rope key ``k_pe [P]``, one shared "head". Attention runs in the *absorbed*
form (DeepSeek-V2 paper, section 2.1.3): the layer projects each head's ``q_nope``
through ``W_UK`` into latent space beforehand, so with ``q = [q_latent | q_pe]`` and each
cached row ``[c_kv | k_pe]`` one dot product gives ``q_nope . k_nope + q_pe . k_pe``; the
output ``softmax . c_kv`` stays in latent space ``[T, H, R]`` and the layer maps it through
``W_UV``. That is multi-query attention with one KV head of width R + P whose value is
the first R columns of the key. Chosen over decompressing K/V from the latent every step
because the decode cost then grows with the context only through an ``(R + P)``-wide dot
product, not through an ``R x H(Dn + Dv)`` projection of every cached token; on CPU the
prefill cost of the wider scores is acceptable. Scores and softmax are float32.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch
import torch.nn.functional as F

from cvllm.attention.interface import AttentionCapabilities, MLABackend
from cvllm.attention.metadata import AttentionMetadata

MAX_ELEMS = 1 << 26
"""Float32 elements (scores + gathered latents) one group may materialise: 256 MiB."""


def write_mla_cache(
    kv_c: torch.Tensor,  # [T, R]
    k_pe: torch.Tensor,  # [T, P]
    kv_cache: torch.Tensor,  # [N, bs, R + P]
    slot_mapping: torch.Tensor,  # [T] int64, no padding slots
) -> None:
    """Store this step's latents and rope keys at their cache slots."""
    row = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)  # [T, R + P]
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping, row)


def forward(
    q_latent: torch.Tensor,  # [T, H, R]: q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [T, H, P]: rotated
    kv_c: torch.Tensor,  # [T, R]: normalised latent
    k_pe: torch.Tensor,  # [T, P]: rotated
    kv_cache: torch.Tensor,  # [N, bs, R + P]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's latents, then attend every sequence's queries over its cached
    context, causally. Returns the latent output ``[T, H, R]`` (padding rows zero)."""
    n, R = meta.num_tokens, kv_c.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != R + k_pe.shape[-1]:
        raise ValueError(f"MLA cache {tuple(kv_cache.shape)} must be [N, bs, {R + k_pe.shape[-1]}]")
    write_mla_cache(kv_c[:n], k_pe[:n], kv_cache, meta.slot_mapping[:n])
    q = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, R + P]
    out = q.new_zeros(q.shape[0], q.shape[1], R)  # [T, H, R]
    _decode(q, kv_cache, meta, float(scale), out)
    _prefill(q, kv_cache, meta, float(scale), out)
    return out


def _decode(q, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Leading one-token sequences (sequence ``b`` owns token ``b``), in groups."""
    nd = meta.num_decodes
    if nd == 0:
        return
    h, width = q.shape[1], kv_cache.shape[-1]
    seq_lens = meta.seq_lens_cpu[:nd]
    for b0, b1 in _plan_decode_groups(seq_lens, h, width):
        L = int(seq_lens[b0:b1].max())
        kv = _gather(kv_cache, meta.block_tables[b0:b1], L)  # [Bg, L, R + P]
        qpos = (meta.seq_lens[b0:b1].long() - 1).unsqueeze(1)  # [Bg, 1]
        out[b0:b1] = _attend(q[b0:b1].unsqueeze(1), kv, qpos, scale, out.shape[-1])[:, 0]


def _prefill(q, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Sequences after the decodes, one at a time, in query chunks that fit the budget."""
    h, width = q.shape[1], kv_cache.shape[-1]
    qsl = meta.query_start_loc_cpu
    for b in range(meta.num_decodes, meta.num_seqs):
        t0, t1 = int(qsl[b]), int(qsl[b + 1])
        seq_len = int(meta.seq_lens_cpu[b])
        ctx = seq_len - (t1 - t0)  # tokens cached before this step
        chunk = max(1, (MAX_ELEMS - seq_len * width) // max(h * seq_len, 1))
        bt = meta.block_tables[b : b + 1]
        for i0 in range(0, t1 - t0, chunk):
            i1 = min(i0 + chunk, t1 - t0)
            kv = _gather(kv_cache, bt, ctx + i1)  # [1, L, R + P]: later keys are masked anyway
            qpos = torch.arange(ctx + i0, ctx + i1, device=q.device).unsqueeze(0)  # [1, Qc]
            qc = q[t0 + i0 : t0 + i1].unsqueeze(0)  # [1, Qc, H, R + P]
            out[t0 + i0 : t0 + i1] = _attend(qc, kv, qpos, scale, out.shape[-1])[0]


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, L: int) -> torch.Tensor:
    """The first ``L`` cached rows of each table's sequence: ``[B, L, R + P]``."""
    B, bs = block_tables.shape[0], cache.shape[1]
    nb = -(-L // bs)
    if nb > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns, {nb} needed for {L} tokens"
        )
    g = cache.index_select(0, block_tables[:, :nb].reshape(-1))  # [B*nb, bs, R + P]
    return g.view(B, nb * bs, cache.shape[-1])[:, :L]


def _attend(
    q: torch.Tensor,  # [B, Q, H, R + P]
    kv: torch.Tensor,  # [B, L, R + P]
    qpos: torch.Tensor,  # [B, Q]: key j is visible iff j <= qpos
    scale: float,
    R: int,
) -> torch.Tensor:
    """One-KV-head attention whose value is the latent part of the key -> ``[B, Q, H, R]``."""
    visible = torch.arange(kv.shape[1], device=q.device) <= qpos.unsqueeze(-1)  # [B, Q, L]
    qf = q.float().transpose(1, 2)  # [B, H, Q, R + P]
    kf = kv.float().unsqueeze(1)  # [B, 1, L, R + P]
    o = F.scaled_dot_product_attention(
        qf, kf, kf[..., :R], attn_mask=visible.unsqueeze(1), scale=scale, enable_gqa=True
    )  # [B, H, Q, R]
    return o.transpose(1, 2).to(q.dtype)


def _plan_decode_groups(seq_lens, h: int, width: int) -> Iterator[Tuple[int, int]]:
    """Contiguous decode groups whose padded scores + latents fit ``MAX_ELEMS``."""
    b0, n = 0, len(seq_lens)
    while b0 < n:
        b1, lm = b0 + 1, int(seq_lens[b0])
        while b1 < n:
            l2 = max(lm, int(seq_lens[b1]))
            if (b1 + 1 - b0) * l2 * (h + width) > MAX_ELEMS:
                break
            b1, lm = b1 + 1, l2
        yield b0, b1
        b0 = b1


class TorchRefMLABackend(MLABackend):
    """The MLA backend ``layers/mla.py`` holds: host-planned (no CUDA graphs), model-dtype
    latents (no FP8 cache)."""

    name = "torch_ref_mla"
    capabilities = AttentionCapabilities()
    forward = staticmethod(forward)
