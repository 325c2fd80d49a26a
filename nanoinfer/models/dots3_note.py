"""dots3 note's text model (`Dots3NoteForCausalLM`; the language model of `Dots3NoteForConditionalGeneration`):
DeepSeek-V3.2 (deepseek_v32.py) whose "indexed_attention" layers are MLA with DeepSeek sparse attention (the indexer
GLM-MoE-DSA's: interleaved rope, a key cached per layer), and whose "sliding_attention" layers are MLA of their own
widths (transformers' per-layer config: heads, LoRA ranks, head dims) over a sliding window, without an indexer. Every
MLA has LongCat-Flash's LoRA scales (the scaled query latent is also the indexer's input), an RMSNorm over the shared
rope key before it turns, the config's rms_norm_eps in its latent norms, and a sigmoid gate per head (g_proj) on its
output; each layer type has its own rope base. The MoE is DeepSeek-V3's, its shared experts
`shared_experts_intermediate_size` wide each."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import ColumnParallelLinear
from nanoinfer.layers.rotary_embedding import rope_parameters
from nanoinfer.models.config_checks import check_each_in, config_source
from nanoinfer.models.deepseek_v3 import DeepseekV3MoE, mlp_layer_type
from nanoinfer.models.deepseek_v32 import (DeepseekV32Attention, DeepseekV32DecoderLayer, DeepseekV32ForCausalLM,
                                           DeepseekV32Model, DSAOptions, check_dsa_config)
from nanoinfer.models.llama import AttentionOptions, LlamaMLP, MLPFactory, OptionsFactory, layer_sliding_window
from nanoinfer.models.longcat_flash import LongcatFlashMLA

_LAYER_TYPES = ("indexed_attention", "sliding_attention")


class Dots3NoteAttention(DeepseekV32Attention, LongcatFlashMLA):
    """LongcatFlashMLA gives the LoRA scales and the scaled latent; the query latent is scaled here, before the
    indexer reads it."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(config, options)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.k_rope_only_layernorm = RMSNorm(self.rope_dim, config.rms_norm_eps)
        self.g_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads)  # over heads, as q

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_latent = self.q_a_layernorm(self.q_a_proj(x)) * self.q_scale
        q = self.q_b_proj(q_latent).view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        o = self.sparse_attention(positions, x, q, q_latent, meta).view(-1, self.num_heads, self.v_dim)
        return self.o_proj((o * torch.sigmoid(self.g_proj(x))[..., None]).flatten(1))

    def rope_key(self, k_rope: torch.Tensor) -> torch.Tensor:
        return self.k_rope_only_layernorm(k_rope)


class Dots3NoteDecoderLayer(DeepseekV32DecoderLayer):
    attention_class = Dots3NoteAttention


class Dots3NoteModel(DeepseekV32Model):
    decoder_layer = Dots3NoteDecoderLayer

    def make_layer(self, config: PretrainedConfig, layer_idx: int, attention_options: OptionsFactory,
                   make_mlp: MLPFactory) -> nn.Module:
        """The layer's attention on its own config (a sliding layer's MLA widths differ)."""
        return self.decoder_layer(config.per_layer_config[layer_idx], attention_options(config, layer_idx),
                                  make_mlp(config, layer_idx))


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot run, refused by name rather than run differently from transformers."""
    where = config_source(config)
    check_each_in(config, "layer_types", _LAYER_TYPES)  # not "full_attention": use_dsa=False, dense MLA
    for i, layer_type in enumerate(config.layer_types):
        rope_type = rope_parameters(config, layer_type)["rope_type"]
        if rope_type != "default":  # transformers scales no softmax for it, as nanoinfer's MLA would
            raise ValueError(f"rope_type={rope_type!r} of the {layer_type} layers in {where} is not supported; only "
                             f"'default' is")
        if layer_type == "indexed_attention":  # (transformers refuses a sliding layer without q_lora_rank)
            check_dsa_config(config.per_layer_config[i])
    if config.mlp_bias:  # transformers' text MLPs have no biases
        raise ValueError(f"mlp_bias={config.mlp_bias!r} in {where} is not supported")


class Dots3NoteForCausalLM(DeepseekV32ForCausalLM):
    model_class = Dots3NoteModel
    check_config = staticmethod(check_config)
    fp16_fp32_modules = ()  # transformers' dots3 note keeps its indexer in the model's dtype

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> DSAOptions:
        layer_type = config.layer_types[layer_idx]
        return DSAOptions(rope_interleaved=True, indexer=layer_type == "indexed_attention",
                          indexer_rope_interleaved=True, sliding_window=layer_sliding_window(config, layer_idx),
                          rope_layer_type=layer_type, rotary_dim=config.per_layer_config[layer_idx].qk_rope_head_dim)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if mlp_layer_type(config, layer_idx) == "dense":
            return LlamaMLP(config)
        return DeepseekV3MoE(config, shared_intermediate_size=config.shared_experts_intermediate_size *
                             config.n_shared_experts)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        # transformers skips the checkpoints' multi-token-prediction layer (after the last one) and `mtp` weights.
        self.ignored_weight_prefixes = (f"model.layers.{config.num_hidden_layers}.", "model.mtp.")
