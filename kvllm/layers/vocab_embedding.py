"""The token embedding and the LM head, split along the vocabulary over the tensor-parallel ranks.

With N ranks the vocabulary is padded to a multiple of N and rank r holds rows [r * V/N, (r+1) * V/N)
(padding rows are zero). The embedding looks up the ids that fall in its rows, zeroes the others and
sums over the ranks; the LM head's logits are gathered from the ranks and cut back to the model's
vocabulary. At TP=1 both are the plain [vocab, hidden] matrix and run as nn.Embedding / F.linear did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.distributed.communication import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from kvllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding's `weight` ([vocab, hidden] at TP=1; this rank's rows of the padded vocab else)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim  # nn.Embedding's names
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        nn.init.normal_(self.weight)  # nn.Embedding's init, for modules built in tests
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the checkpoint's [vocab, hidden] matrix (zeros past the vocab)."""
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"shape mismatch: parameter {expected}, checkpoint {tuple(loaded_weight.shape)}")
        rows = self.vocab_end_index - self.vocab_start_index
        param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start_index, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(mine, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(~mine.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection [vocab, hidden], split like the embedding (whose weight a tied model uses)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits through gather_logits, not as an embedding")


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V/ranks] logits of this rank's vocab rows -> [N, vocab_size] on every rank (TP=1: as is)."""
    if get_tensor_model_parallel_world_size() == 1:
        return logits
    return tensor_model_parallel_all_gather(logits, dim=-1)[:, :vocab_size].contiguous()
