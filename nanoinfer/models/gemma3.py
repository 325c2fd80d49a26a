"""Gemma 3 (text): Gemma 2 (gemma2.py) with (1 + weight) q/k norms and, per layer type, its own rope (a local one on
sliding layers, a global one, with its scaling, on full ones)."""
from dataclasses import replace

from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.models import gemma2
from nanoinfer.models.llama import AttentionOptions


class Gemma3ForCausalLM(gemma2.Gemma2ForCausalLM):
    @staticmethod
    def check_config(config: PretrainedConfig) -> None:
        """Gemma 2's checks, and attention-logit softcapping refused: transformers' Gemma 3 reads the setting but
        never applies it, so there is no reference for what a Gemma 3 with it should compute."""
        if config.attn_logit_softcapping is not None:
            raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping} in the model config: "
                             "transformers' Gemma 3 does not apply it, and nanoinfer does not guess")
        gemma2.check_config(config)

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        """Gemma 2's, plus q/k norms as its RMSNorm (1 + weight, in fp32) and the rope settings of the layer's type
        (its config nests them by "sliding_attention" / "full_attention")."""
        return replace(gemma2.attention_options(config, layer_idx), qk_norm=True, qk_norm_class=GemmaRMSNorm,
                       rope_layer_type=config.layer_types[layer_idx])
