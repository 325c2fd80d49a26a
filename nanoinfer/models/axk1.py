"""A.X-K1 (`AXK1ForCausalLM`): DeepSeek-V3 (deepseek_v3.py: MLA with the low-rank q, the sigmoid-routed MoE with its
correction bias in the best groups, shared experts) with an RMSNorm on each MoE's output (`post_mlp_layernorm`, held
by the layer in the checkpoints) before the residual add; dense or sparse MLPs as `mlp_layer_types` says (transformers
5.17: the first `first_k_dense_replace` dense)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.models.deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2Model
from nanoinfer.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE, deepseek_v3_mlp, mlp_by_layer_type
from nanoinfer.models.llama import AttentionOptions


class AXK1DecoderLayer(DeepseekV2DecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        self.post_mlp_layernorm = (RMSNorm(config.hidden_size, config.rms_norm_eps)
                                   if isinstance(mlp, DeepseekV3MoE) else None)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = super().forward(positions, x, residual, meta)
        return (x if self.post_mlp_layernorm is None else self.post_mlp_layernorm(x)), residual


class AXK1Model(DeepseekV2Model):
    decoder_layer = AXK1DecoderLayer


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    model_class = AXK1Model

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if getattr(config, "mlp_layer_types", None) is None:  # transformers 5.17's config
            return deepseek_v3_mlp(config, layer_idx)
        return mlp_by_layer_type(config, layer_idx)
