"""Vocabulary-parallel token embedding and LM head.

Built by the model classes. Each rank holds rows ``[vocab_start_index, vocab_end_index)``
of the vocabulary padded to a multiple of ``padding_size * tp_size`` (padding rows are
zero); the embedding masks foreign ids and all-reduces, the LM head's logits are gathered
and cut back to the real vocabulary by ``LogitsProcessor``. With tied embeddings the LM
head shares the embedding's parameter (``ParallelLMHead.tie_weights``). The weight loader
narrows the (maybe lazy) checkpoint tensor to this rank's rows before reading it. The
logits all-gather is a collective: with tp_size > 1 every rank computes logits for every
step that has sampling rows, although only rank 0 samples.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from cvllm.distributed import parallel_state
from cvllm.distributed.comm import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from cvllm.layers.utils import copy_checked, divide
from cvllm.quantization.base import EmbeddingMethodBase, QuantizationConfig, frozen_param
from cvllm.quantization.packed import weight_view
from cvllm.quantization.unquantized import UnquantizedEmbeddingMethod

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int) -> int:
    return -(-vocab_size // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: Optional[torch.dtype] = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
        quant_config: Optional[QuantizationConfig] = None,
    ):
        super().__init__()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(
            self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings
        )
        dtype = params_dtype or torch.get_default_dtype()
        self.params_dtype = dtype
        method = None
        if quant_config is not None:
            method = quant_config.get_embedding_method(
                self, prefix, is_lm_head=isinstance(self, ParallelLMHead))
        self.quant_method: EmbeddingMethodBase = method or UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(self, self.num_embeddings_per_partition, embedding_dim,
                                         dtype, weight_loader=self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"shape mismatch: checkpoint vocabulary {loaded_weight.shape[0]} "
                f"vs config vocab_size {self.num_embeddings}"
            )
        n = max(self.vocab_end_index - self.vocab_start_index, 0)
        dst = weight_view(param)
        if dst.dim() == 1:  # a bias
            if n:
                copy_checked(dst[:n], loaded_weight.narrow(0, self.vocab_start_index, n))
            dst[n:].zero_()
            return
        rows = dst.shape[0]
        if n:  # narrow first: a lazy checkpoint tensor reads only this rank's rows
            copy_checked(dst.narrow(0, 0, n), loaded_weight.narrow(0, self.vocab_start_index, n))
        if rows > n:
            dst.narrow(0, n, rows - n).zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_ids)  # [T, hidden]
        mine = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)  # [T]
        local = (input_ids - self.vocab_start_index) * mine
        out = self.quant_method.embedding(self, local).masked_fill_(
            ~mine.unsqueeze(-1), 0)  # [T, hidden]
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings} (padded {self.num_embeddings_padded}), "
            f"dim={self.embedding_dim}, "
            f"rows [{self.vocab_start_index}, {self.vocab_end_index})"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the (sharded) vocabulary; used through ``LogitsProcessor``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
        quant_config: Optional[QuantizationConfig] = None,
    ):
        super().__init__(num_embeddings, embedding_dim, params_dtype, padding_size, prefix,
                         quant_config)
        if bias:
            self.bias = frozen_param(  # [V_per_partition]
                torch.empty(self.num_embeddings_per_partition, dtype=self.params_dtype),
                output_dim=0, weight_loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share the embedding's parameter and method (tie_word_embeddings): a quantized
        embedding's prepared rows serve as the head's weight too."""
        self.weight = embed_tokens.weight
        self.quant_method = embed_tokens.quant_method
        self.quant_method.tie_as_head()
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied through LogitsProcessor, not called directly")


class LogitsProcessor(nn.Module):
    """``hidden [S, hidden] -> logits [S, vocab]`` float32, gathered over TP ranks."""

    def __init__(self, vocab_size: int, scale: float = 1.0, soft_cap: Optional[float] = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = scale
        self.soft_cap = soft_cap

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = lm_head.quant_method.apply(
            lm_head, hidden_states, lm_head.bias
        )  # [S, V_per_partition]
        logits = tensor_model_parallel_all_gather(logits)  # [S, V_padded]
        logits = logits[..., : self.vocab_size].float()  # [S, V]
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits
