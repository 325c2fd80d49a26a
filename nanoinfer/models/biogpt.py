"""BioGPT: OPT's pre-norm decoder (fairseq's layout: separate q/k/v/out projections with biases, a dense MLP fc1 / fc2
with biases, learned absolute positions offset by 2 rows) with token embeddings scaled by sqrt(hidden_size) where
`scale_embedding`, every LayerNorm at nn.LayerNorm's default epsilon (the config's `layer_norm_eps` is not read), the
LM head `output_projection`, tied. XGLM (xglm.py) is the same model on sinusoidal positions."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.models.gpt2 import GPT2Model
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, MLPFactory, OptionsFactory
from nanoinfer.models.opt import LAYER_NORM_EPS, OPTForCausalLM


class BioGptDecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, LAYER_NORM_EPS)


class BioGptModel(GPT2Model):
    decoder_layer = BioGptDecoderLayer
    position_offset = 2

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.embed_scale = config.hidden_size ** 0.5 if config.scale_embedding else 1.0

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return LayerNorm(config.hidden_size, LAYER_NORM_EPS)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.add_positions(self.embed_tokens(input_ids) * self.embed_scale, positions)


class BioGptForCausalLM(LlamaForCausalLM):
    model_class = BioGptModel
    # transformers' BioGptForCausalLM files: the decoder under `biogpt.`; then OPT's names for the rest.
    weight_name_substitutions = {"^biogpt.": "model.", "^output_projection.": "lm_head.",
                                 "^model.layer_norm.": "model.norm.",
                                 "^model.embed_positions.": "model.wpe.", **OPTForCausalLM.weight_name_substitutions}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=True, rope=False)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True)
