"""BLOOM: ALiBi in place of position embeddings (BLOOM's slopes), a LayerNorm on the embeddings
(`word_embeddings_layernorm`), pre-norm layers one after the other with LayerNorms, the fused `query_key_value` laid
out per head as GPT-NeoX's, a dense MLP of BLOOM's GeLU, biases everywhere, the LM head tied to the embeddings."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention.alibi import bloom_alibi_slopes
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.models.gpt_neox import GPTNeoXAttention
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, MLPFactory, OptionsFactory


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    if config.apply_residual_connection_post_layernorm:
        raise ValueError("apply_residual_connection_post_layernorm=True in the model config: not supported for bloom")


class BloomBlock(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(GPTNeoXAttention(config, options), mlp, config.hidden_size, config.layer_norm_epsilon)


class BloomModel(LayerNormModel):
    decoder_layer = BloomBlock

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.word_embeddings_layernorm = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.word_embeddings_layernorm(self.embed_tokens(input_ids))


class BloomForCausalLM(LlamaForCausalLM):
    model_class = BloomModel
    packed_modules_mapping = {}  # query_key_value holds q, k and v per head: its layer's weight_loader splits them
    check_config = staticmethod(check_config)
    # transformers' BloomForCausalLM files name the decoder's tensors `transformer.*`; the Hub's BLOOM files
    # (BloomModel's) name them without a prefix.
    weight_name_substitutions = {
        "^transformer.": "",
        "^h.": "model.layers.",
        "^word_embeddings.": "model.embed_tokens.",
        "^word_embeddings_layernorm.": "model.word_embeddings_layernorm.",
        "^ln_f.": "model.norm.",
        ".self_attention.query_key_value.": ".self_attn.qkv_proj.",
        ".self_attention.dense.": ".self_attn.o_proj.",
        ".mlp.dense_h_to_4h.": ".mlp.fc1.",
        ".mlp.dense_4h_to_h.": ".mlp.fc2.",
    }

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=True, rope=False,
                                alibi_slopes=bloom_alibi_slopes(config.num_attention_heads))

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True, 4 * config.hidden_size, "bloom_gelu")

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
