"""MiniCPM3: DeepSeek-V2's multi-head latent attention (deepseek_v2.py) with rope in the rotate-half layout, in
Granite's muP decoder (granite.py) under MiniCPM's names: embeddings times `scale_emb`, each sublayer's output times
`scale_depth / sqrt(num_hidden_layers)`, logits over `hidden_size / dim_model_base`; Llama's MLP on every layer."""
import math

from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.embed_head import ScaledEmbedding
from nanoinfer.models.deepseek_v2 import DeepseekV2Attention, DeepseekV2ForCausalLM
from nanoinfer.models.granite import GraniteDecoderLayer, GraniteForCausalLM, GraniteModel
from nanoinfer.models.llama import AttentionOptions


class MiniCPM3DecoderLayer(GraniteDecoderLayer):
    attention_class = DeepseekV2Attention

    @staticmethod
    def mup_residual_multiplier(config: PretrainedConfig) -> float:
        return config.scale_depth / math.sqrt(config.num_hidden_layers)


class MiniCPM3Model(GraniteModel):
    decoder_layer = MiniCPM3DecoderLayer

    @staticmethod
    def token_embedding(config: PretrainedConfig) -> nn.Module:
        """Times scale_emb, inside the module as transformers has it."""
        return ScaledEmbedding(config.vocab_size, config.hidden_size, config.scale_emb)

    @staticmethod
    def mup_embedding_multiplier(config: PretrainedConfig) -> float:
        return 1.0  # scale_emb is the embedding module's


class MiniCPM3ForCausalLM(GraniteForCausalLM):
    """Its config's `logits_scaling` (a property: hidden_size / dim_model_base) is the divisor Granite's is."""
    model_class = MiniCPM3Model
    packed_modules_mapping = DeepseekV2ForCausalLM.packed_modules_mapping

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions()  # the scale is MLA's own (deepseek_v2.softmax_scale), the rope not interleaved
