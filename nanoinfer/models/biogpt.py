"""BioGPT: OPT's pre-norm decoder (fairseq's layout: separate q/k/v/out projections with biases, a dense MLP fc1 / fc2
with biases, learned absolute positions offset by 2 rows) with token embeddings scaled by sqrt(hidden_size) where
`scale_embedding`, every LayerNorm at nn.LayerNorm's default epsilon (the config's `layer_norm_eps` is not read), the
LM head `output_projection`, tied. XGLM (xglm.py) is the same model on sinusoidal positions."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.embed_head import ScaledEmbedding
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.models.gpt2 import GPT2Model, biased_attention
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM
from nanoinfer.models.opt import LAYER_NORM_EPS, OPTForCausalLM


class BioGptDecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, LAYER_NORM_EPS)


class BioGptModel(GPT2Model):
    decoder_layer = BioGptDecoderLayer
    position_offset = 2

    @staticmethod
    def token_embedding(config: PretrainedConfig) -> nn.Module:
        """Times sqrt(hidden) with scale_embedding, inside the module as transformers' (XGLM's too)."""
        return ScaledEmbedding(config.vocab_size, config.hidden_size,
                               config.hidden_size ** 0.5 if config.scale_embedding else 1.0)

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return LayerNorm(config.hidden_size, LAYER_NORM_EPS)


class BioGptForCausalLM(LlamaForCausalLM):
    model_class = BioGptModel
    # transformers' BioGptForCausalLM files: the decoder under `biogpt.`; then OPT's names for the rest.
    weight_name_substitutions = {"^biogpt.": "model.", "^output_projection.": "lm_head.",
                                 "^model.layer_norm.": "model.norm.",
                                 "^model.embed_positions.": "model.wpe.", **OPTForCausalLM.weight_name_substitutions}

    attention_options = staticmethod(biased_attention)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True)
