"""GPT-Neo: GPT-2's layout (learned absolute positions, pre-norm LayerNorms, a dense "gelu_new" MLP c_fc / c_proj
with biases, tied embeddings) with nn.Linear weights, separate q/k/v projections without biases (out_proj has one),
scores not scaled by 1/sqrt(head_dim), and layers alternating global and local attention (`attention_layers`): a
local layer's query sees the last `window_size` positions, its own included (transformers' mask keeps
p - window_size < key <= p), which is a sliding window here."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.gpt2 import GPT2Model
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM

ATTENTION_TYPES = ("global", "local")


class GPTNeoBlock(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, config.layer_norm_epsilon)


class GPTNeoModel(GPT2Model):
    decoder_layer = GPTNeoBlock


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    unknown = sorted(set(config.attention_layers) - set(ATTENTION_TYPES))
    if unknown:
        raise ValueError(f"attention_layers={config.attention_layers} in the model config: {unknown} not supported "
                         f"for {config.model_type} (only {ATTENTION_TYPES})")


class GPTNeoForCausalLM(LlamaForCausalLM):
    model_class = GPTNeoModel
    check_config = staticmethod(check_config)
    weight_name_substitutions = {
        "^transformer.h.": "model.layers.",
        "^transformer.wte.": "model.embed_tokens.",
        "^transformer.wpe.": "model.wpe.",
        "^transformer.ln_f.": "model.norm.",
        ".ln_1.": ".input_layernorm.",
        ".ln_2.": ".post_attention_layernorm.",
        ".attn.attention.": ".self_attn.",
        ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".mlp.c_fc.": ".mlp.fc1.",
        ".mlp.c_proj.": ".mlp.fc2.",
    }
    # The Hub's files also hold the attention's mask buffers (causal, or causal and windowed).
    ignored_weight_suffixes = (".attn.attention.bias", ".attn.attention.masked_bias")

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        window = config.window_size if config.attention_layers[layer_idx] == "local" else None
        return AttentionOptions(o_bias=True, rope=False, scale=1.0, sliding_window=window)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True, config.intermediate_size or 4 * config.hidden_size, config.activation_function)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
