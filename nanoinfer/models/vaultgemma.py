"""VaultGemma (`VaultGemmaForCausalLM`): Gemma 2's attention (query_pre_attn_scalar, logit softcapping, windows by
layer_types), MLP and final-logit softcapping in Gemma's layer of two norms, the second named
`pre_feedforward_layernorm`."""
from nanoinfer.models.gemma import GemmaModel
from nanoinfer.models.gemma2 import Gemma2ForCausalLM


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    model_class = GemmaModel
    weight_name_substitutions = {".pre_feedforward_layernorm.": ".post_attention_layernorm."}
