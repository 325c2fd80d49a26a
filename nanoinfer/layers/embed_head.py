"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary
(padded so that all slices are equal); the LM head gathers the logits on rank 0, which samples."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.linear import copy_weight, linear, pack_weight
from nanoinfer.utils.dist import tp_group, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        """dtype: the weight's, None: the model's."""
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = tp_rank(), tp_size(), tp_group()
        self.num_embeddings = num_embeddings
        # Pad so every rank holds the same number of rows; padded rows are never real tokens.
        self.num_embeddings_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim, dtype=dtype),
                                   requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"shape mismatch: checkpoint vocabulary {loaded.shape[0]}, model {self.num_embeddings}")
        rows = max(0, min(self.num_embeddings - self.vocab_start, self.num_embeddings_per_rank))
        param.data[rows:].zero_()
        copy_weight(param.data.narrow(0, 0, rows), loaded.narrow(0, min(self.vocab_start, self.num_embeddings), rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        local = x - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings_per_rank)
        y = F.embedding(local.clamp(0, self.num_embeddings_per_rank - 1), self.weight) * mine.unsqueeze(-1)
        dist.all_reduce(y, group=self.tp_group)
        return y


class ScaledEmbedding(VocabParallelEmbedding):
    """The lookup times a constant, inside the module as transformers' scaled word embeddings have it (Gemma's,
    BioGPT's, MiniCPM3's): a prompt embedding stands for this module's output (see model_runner.prompt_embedding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class ParallelLMHead(VocabParallelEmbedding):
    packed_weight: torch.Tensor | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, dtype: torch.dtype | None = None,
                 fp32_logits: bool = False):
        """bias (Phi's): one per vocabulary entry, sliced and padded as the weight's rows (same weight_loader). dtype:
        the weight's and the bias's (HY-V4's fp32 head in every model dtype), the hidden states cast to it.
        fp32_logits: a 16-bit head's logits accumulated in fp32 and never rounded to 16 bits (Ergo's, as transformers'
        ErgoLinearWithFP32Output computes them); no bias then."""
        super().__init__(num_embeddings, embedding_dim, dtype)
        self.bias = (nn.Parameter(torch.empty(self.num_embeddings_per_rank, dtype=dtype), requires_grad=False) if bias
                     else None)
        self.fp32_logits = fp32_logits

    def process_weights_after_loading(self, batch_size_hint: int) -> None:
        # The dense weight stays: it may be the (tied) input embedding too.
        self.packed_weight = pack_weight(self.weight, batch_size_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits over the full vocabulary for the given hidden states (callers pass only rows they sample);
        None on ranks other than 0."""
        x = x.to(self.weight.dtype)
        if self.fp32_logits and x.dtype != torch.float32:
            logits = fp32_matmul(x, self.weight)
        else:
            logits = linear(x, self.weight, self.bias, self.packed_weight)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
            dist.gather(logits, parts, dst=0, group=self.tp_group)
            if parts is None:
                return None
            logits = torch.cat(parts, -1)
        return logits[:, :self.num_embeddings].float()


def fp32_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T of 16-bit operands accumulated into fp32 logits: on CUDA torch.mm's fp32 output, elsewhere the operands
    upcast first (torch.mm has no fp32 output there), as transformers' ErgoLinearWithFP32Output does on each."""
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())
