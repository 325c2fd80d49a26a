"""MPT (MosaicML): ALiBi in place of position embeddings (MPT's slopes, `alibi_bias_max`), the fused `Wqkv` (q, k, v
stacked) clamped to `clip_qkv` where set, scores scaled by `softmax_scale` (default head_dim^-0.5), pre-norm layers one
after the other with bias-free LayerNorms, an exact-GeLU MLP (`expansion_ratio`), no biases (`no_bias`), the LM head
tied to the embeddings. `attn_config` settings that transformers does not implement are refused by name."""
from functools import partial

from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention.alibi import mpt_alibi_slopes
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM

# attn_config settings this implementation (as transformers' MptForCausalLM) runs only at these values.
SUPPORTED_ATTN_CONFIG = {"attn_type": "multihead_attention", "prefix_lm": False, "qk_ln": False, "alibi": True}


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from MPT: transformers builds
    neither biases, nor q/k LayerNorms, nor learned positions, nor multi-query or prefix-LM attention, whatever the
    config says."""
    for name, supported in SUPPORTED_ATTN_CONFIG.items():
        value = getattr(config.attn_config, name)
        if value != supported:
            raise ValueError(f"attn_config.{name}={value!r} in the model config: not supported for mpt (only "
                             f"{supported!r})")
    if not config.no_bias:
        raise ValueError("no_bias=False in the model config: not supported for mpt (biases)")
    if config.logit_scale is not None:
        raise ValueError(f"logit_scale={config.logit_scale!r} in the model config: not supported for mpt")


class MptBlock(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, config.layer_norm_epsilon,
                         norm=partial(LayerNorm, bias=False))


class MptModel(LayerNormModel):
    decoder_layer = MptBlock
    norm_bias = False


class MptForCausalLM(LlamaForCausalLM):
    model_class = MptModel
    packed_modules_mapping = {}  # Wqkv holds q, k and v stacked: its layer's weight_loader splits them
    check_config = staticmethod(check_config)
    weight_name_substitutions = {
        "^transformer.blocks.": "model.layers.",
        "^transformer.wte.": "model.embed_tokens.",
        "^transformer.norm_f.": "model.norm.",
        ".norm_1.": ".input_layernorm.",
        ".norm_2.": ".post_attention_layernorm.",
        ".attn.Wqkv.": ".self_attn.qkv_proj.",
        ".attn.out_proj.": ".self_attn.o_proj.",
        ".ffn.up_proj.": ".mlp.fc1.",
        ".ffn.down_proj.": ".mlp.fc2.",
    }

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        attn = config.attn_config
        return AttentionOptions(rope=False, scale=attn.softmax_scale, clip_qkv=attn.clip_qkv,
                                alibi_slopes=mpt_alibi_slopes(config.num_attention_heads, attn.alibi_bias_max))

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, False, config.expansion_ratio * config.hidden_size, "gelu")

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
