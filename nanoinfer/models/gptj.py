"""GPT-J: one LayerNorm feeding the attention and the MLP in parallel, x + attn(ln(x)) + mlp(ln(x)); interleaved rope
over the leading `rotary_dim` dims of each head (theta 10,000); no attention biases; a dense "gelu_new" MLP (fc_in,
fc_out) with biases; an LM head with a bias."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM


class GPTJBlock(LayerNormDecoderLayer):
    attention_class: type[LlamaAttention] = LlamaAttention  # CodeGen's loads its own qkv_proj layout

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(self.attention_class(config, options), mlp, config.hidden_size, config.layer_norm_epsilon,
                         "parallel-one-norm")


class GPTJModel(LayerNormModel):
    decoder_layer = GPTJBlock


class GPTJForCausalLM(LlamaForCausalLM):
    model_class = GPTJModel
    lm_head_bias = True
    weight_name_substitutions = {
        "^transformer.h.": "model.layers.",
        "^transformer.wte.": "model.embed_tokens.",
        "^transformer.ln_f.": "model.norm.",
        ".ln_1.": ".input_layernorm.",
        ".attn.": ".self_attn.",
        ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".mlp.fc_in.": ".mlp.fc1.",
        ".mlp.fc_out.": ".mlp.fc2.",
    }
    # The Hub's files also hold the attention's causal-mask buffers.
    ignored_weight_suffixes = (".attn.bias", ".attn.masked_bias")

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(rope_interleaved=True, rotary_dim=config.rotary_dim)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True, config.n_inner or 4 * config.hidden_size, config.activation_function)
