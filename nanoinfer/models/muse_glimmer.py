"""Muse Glimmer's language model (`muse_glimmer_text`, run text only under MuseGlimmerForConditionalGeneration): Gemma
2's layer (four (1 + weight) RMSNorms, the two after the sublayers with `post_norm_eps`; windows on the layers
`layer_types` marks "sliding_attention") with weightless q/k RMSNorms, the query times `qk_scale_factor`, no rope on the
layers whose `layer_rope_theta` is 0, the attention output times sigmoid(gate_proj(x)) per element; the embeddings
RMS-normed without a weight, a final RMSNorm applying its weight in fp32; logits times `output_multiplier`, then
softcapped by `final_logit_softcapping`, as the wrapper computes them (which also embeds its media placeholder ids
as id 0: vision_language.MEDIA_TOKEN_STAND_INS)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import OlmoRMSNorm, WeightlessRMSNorm
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.gemma2 import Gemma2DecoderLayer, check_layer_types
from nanoinfer.models.inkling import NormedEmbedding
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP, LlamaModel, layer_sliding_window


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    check_layer_types(config)
    theta = config.rope_parameters["rope_theta"]
    for i, layer_theta in enumerate(config.layer_rope_theta):
        # transformers turns every rope layer by the global base, whatever its entry says.
        if layer_theta not in (0, theta):
            raise ValueError(f"layer_rope_theta[{i}]={layer_theta!r} in {config_source(config)} is not supported; "
                             f"expected 0 (no rope) or rope_theta ({theta})")


def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    bias = config.attention_bias
    # qk_scale_factor on the normed query folded into the score scale: rope is linear.
    return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_class=WeightlessRMSNorm,
                            scale=config.head_dim ** -0.5 * config.qk_scale_factor,
                            rope=bool(config.layer_rope_theta[layer_idx]),
                            sliding_window=layer_sliding_window(config, layer_idx), gate_activation=torch.sigmoid)


class MuseGlimmerDecoderLayer(Gemma2DecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        self.post_attention_layernorm.eps = self.post_feedforward_layernorm.eps = config.post_norm_eps


class MuseGlimmerModel(LlamaModel):
    decoder_layer = MuseGlimmerDecoderLayer

    @staticmethod
    def token_embedding(config: PretrainedConfig) -> nn.Module:
        return NormedEmbedding(config.vocab_size, config.hidden_size, config.rms_norm_eps, WeightlessRMSNorm)

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)


class MuseGlimmerTextForCausalLM(LlamaForCausalLM):
    model_class = MuseGlimmerModel
    weight_name_substitutions = {".self_attn.gate_proj.": ".self_attn.g_proj."}
    wrapper_scales_logits = True  # see vision_language.py
    attention_options = staticmethod(attention_options)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, hidden_act=config.hidden_activation)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
        self.output_multiplier, self.softcap = config.output_multiplier, config.final_logit_softcapping

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        if logits is None:
            return None
        return torch.tanh(logits * self.output_multiplier / self.softcap) * self.softcap
