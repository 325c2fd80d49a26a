"""Mamba (`MambaForCausalLM`, state-spaces/mamba-*-hf) and Mamba2 (`Mamba2ForCausalLM`, state-spaces/mamba2-*,
Codestral Mamba): every layer a norm, the mixer (Mamba-1's or Mamba2's) and the residual add, no MLP.
`residual_in_fp32`: in 16-bit dtypes the residual stream stays in fp32, as transformers keeps it (see
Fp32ResidualRMSNorm); it changes nothing in fp32."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import Fp32ResidualRMSNorm, RMSNorm
from nanoinfer.layers.mamba import MambaMixer, MambaSettings
from nanoinfer.layers.mamba2 import Mamba2Mixer, Mamba2Settings
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM


def mamba_settings(config: PretrainedConfig) -> MambaSettings:
    return MambaSettings(config.hidden_size, config.intermediate_size, config.state_size, config.conv_kernel,
                         int(config.time_step_rank), config.use_conv_bias, config.use_bias, config.hidden_act)


def mamba2_settings(config: PretrainedConfig) -> Mamba2Settings:
    """Mamba2's names: the gated norm's epsilon is the layers' (layer_norm_epsilon), use_bias on both projections."""
    return Mamba2Settings(config.hidden_size, config.num_heads, config.head_dim, config.n_groups, config.state_size,
                          config.conv_kernel, config.chunk_size, config.layer_norm_epsilon, config.use_conv_bias,
                          config.use_bias, config.use_bias, tuple(config.time_step_limit), config.hidden_act)


class MambaForCausalLM(HybridForCausalLM):
    mixer_class: type[nn.Module] = MambaMixer  # built from settings(config)
    weight_name_substitutions = {
        ".norm.": ".input_layernorm.",  # the layers' (the final one is norm_f)
        "backbone.embeddings.": "model.embed_tokens.",
        "backbone.embedding.": "model.embed_tokens.",  # older checkpoints' name (transformers renames it too)
        "backbone.norm_f.": "model.norm.",
        "backbone.": "model.",
    }

    def settings(self, config: PretrainedConfig) -> MambaSettings:
        return mamba_settings(config)

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        norm = Fp32ResidualRMSNorm if config.residual_in_fp32 else RMSNorm
        return HybridDecoderLayer(config, self.mixer_class(self.settings(config)), False, None,
                                  config.layer_norm_epsilon, norm=norm)

    def make_final_norm(self, config: PretrainedConfig, eps: float) -> RMSNorm:
        if config.residual_in_fp32:
            return Fp32ResidualRMSNorm(config.hidden_size, eps, final=True)
        return super().make_final_norm(config, eps)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, config.layer_norm_epsilon)


class Mamba2ForCausalLM(MambaForCausalLM):
    """Mamba's layout (backbone.layers.N.norm / .mixer) around the Mamba2 mixer."""
    mixer_class = Mamba2Mixer
    # The mixer's gated norm is `mixer.norm` too: Mamba's renaming of the layers' norm is undone for it.
    weight_name_substitutions = MambaForCausalLM.weight_name_substitutions | {".mixer.input_layernorm.": ".mixer.norm."}

    def settings(self, config: PretrainedConfig) -> Mamba2Settings:
        return mamba2_settings(config)
