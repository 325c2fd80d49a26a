"""Qwen3.5 text models (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`): Qwen3-Next's layers (qwen3_next.py) with
the linear attention's projections stored per output (q|k|v, z, b, a) instead of grouped by key head; dense MLPs, or
on every layer routed experts (always renormalized) plus the gated shared expert. The text model's multimodal rope
gives a text token the same position on all three axes: plain (partial) rope."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.linear import ColumnParallelLinear, SegmentedColumnParallelLinear
from nanoinfer.models.llama import LlamaMLP
from nanoinfer.models.qwen2_moe import Qwen2MoeSparseMoeBlock
from nanoinfer.models.qwen3_next import (Qwen3NextDecoderLayer, Qwen3NextForCausalLM, Qwen3NextGatedDeltaNet,
                                         Qwen3NextModel)


class Qwen3_5GatedDeltaNet(Qwen3NextGatedDeltaNet):
    def init_projections(self, hidden_size: int, key_dim: int, value_dim: int, num_v_heads: int) -> None:
        # Each output split by heads: a rank's rows of q | k | v are its share of each segment.
        self.in_proj_qkv = SegmentedColumnParallelLinear(hidden_size, [(key_dim, True), (key_dim, True),
                                                                       (value_dim, True)])
        self.in_proj_z = ColumnParallelLinear(hidden_size, value_dim)
        self.in_proj_b = ColumnParallelLinear(hidden_size, num_v_heads)
        self.in_proj_a = ColumnParallelLinear(hidden_size, num_v_heads)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        z = self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    linear_attention_class = Qwen3_5GatedDeltaNet


class Qwen3_5Model(Qwen3NextModel):
    decoder_layer = Qwen3_5DecoderLayer


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    model_class = Qwen3_5Model

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        # transformers' router always rescales the top k to sum to 1 (the config has no norm_topk_prob).
        return Qwen2MoeSparseMoeBlock(config, renormalize=True)
