"""XGLM: BioGPT's decoder (biogpt.py: OPT's pre-norm layers, scaled token embeddings, positions offset by 2) on
fairseq's fixed sinusoidal positions (sines then cosines of position / 10000 ** (i / (d/2 - 1))), whose row
pad_token_id is zeroed as transformers' table is (so with pad_token_id >= 2, position pad_token_id - 2 adds
nothing); MLP width `ffn_dim`, activation `activation_function`. Cross-attention (`add_cross_attention`) is refused."""
import math

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.biogpt import BioGptForCausalLM, BioGptModel
from nanoinfer.models.gpt2 import check_config
from nanoinfer.models.layernorm_decoder import DenseMLP


def sinusoidal_table(num_positions: int, dim: int, padding_idx: int | None) -> torch.Tensor:
    """XGLMSinusoidalPositionalEmbedding.get_embedding's table, [num_positions, dim], computed in fp32."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles), torch.zeros(num_positions, dim % 2)], dim=1)
    if padding_idx is not None:
        table[padding_idx] = 0.0
    return table


class SinusoidalPositions(nn.Module):
    """A fixed table of position embeddings, called as nn.Embedding is; not in the checkpoint."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.register_buffer("table", table.to(torch.get_default_dtype()), persistent=False)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.table[indices]


class XGLMModel(BioGptModel):
    def position_embedding(self, config: PretrainedConfig) -> nn.Module:
        return SinusoidalPositions(sinusoidal_table(config.max_position_embeddings + self.position_offset,
                                                    config.hidden_size, config.pad_token_id))


class XGLMForCausalLM(BioGptForCausalLM):
    model_class = XGLMModel

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True, config.ffn_dim, config.activation_function)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
