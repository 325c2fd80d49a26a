"""Youtu-LLM: DeepSeek-V3's multi-head latent attention (deepseek_v2.py; the rope layout by `rope_interleave`) with
Llama's dense SwiGLU MLP on every layer, no experts."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from nanoinfer.models.llama import LlamaMLP


class YoutuForCausalLM(DeepseekV3ForCausalLM):
    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)
