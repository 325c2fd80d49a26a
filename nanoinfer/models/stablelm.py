"""StableLM (StableLM-2): LayerNorms, partial rotary, a gated SiLU MLP, optional biases on q/k/v (`use_qkv_bias`),
optional per-head LayerNorms on queries and keys (`qk_layernorm`, a weight per head) and optionally the parallel
residual x + attn(ln(x)) + mlp(ln(x)) with one norm (`use_parallel_residual`)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.layernorm_decoder import LayerNormDecoderLayer, LayerNormModel, maybe_per_head_qk_norm_attention
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class StableLmDecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        eps = config.layer_norm_eps
        attention = maybe_per_head_qk_norm_attention(config, options, config.qk_layernorm, eps)
        super().__init__(attention, mlp, config.hidden_size, eps,
                         "parallel-one-norm" if config.use_parallel_residual else "sequential")


class StableLmModel(LayerNormModel):
    decoder_layer = StableLmDecoderLayer


def per_head_norm_shards(name: str, num_heads: int) -> dict[str, tuple[str, int]]:
    """The checkpoint's `{name}.norms.{h}` (one LayerNorm per head) as shard h of the PerHeadLayerNorm `{name}`."""
    return {f"{name}.norms.{h}": (name, h) for h in range(num_heads)}


class StableLmForCausalLM(LlamaForCausalLM):
    model_class = StableLmModel

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.use_qkv_bias)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.packed_modules_mapping = self.config_packed_modules_mapping(config)

    @classmethod
    def config_packed_modules_mapping(cls, config: PretrainedConfig) -> dict[str, tuple[str, int | str]]:
        """The class's mapping and, with qk_layernorm, each head's q/k norm as a shard of its PerHeadLayerNorm
        (how many there are is the config's)."""
        if not config.qk_layernorm:
            return cls.packed_modules_mapping
        heads = config.num_attention_heads
        return {**cls.packed_modules_mapping, **per_head_norm_shards("q_layernorm", heads),
                **per_head_norm_shards("k_layernorm", config.num_key_value_heads or heads)}
