"""OPT: GPT-2's learned absolute positions (the table offset by 2 rows), separate q/k/v projections, biases where
`enable_bias`, a dense ReLU MLP (fc1, fc2) and a tied LM head; pre-norm (`do_layer_norm_before`, the final
LayerNorm unless `_remove_final_layer_norm`) or post-norm (OPT-350m: each LayerNorm after its add, no final norm);
token embeddings `word_embed_proj_dim` wide, projected in to the hidden size (`project_in`) and the final hidden
states back out (`project_out`) where the two differ (OPT-350m)."""
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.gpt2 import GPT2Model
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, ResidualSum
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, MLPFactory, OptionsFactory

LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default: OPT's config has no epsilon


def layer_norm(config: PretrainedConfig) -> Callable[[int, float], LayerNorm]:
    """OPT's LayerNorm: with weight and bias unless `layer_norm_elementwise_affine` is false."""
    affine = config.layer_norm_elementwise_affine
    return lambda hidden_size, eps: LayerNorm(hidden_size, eps, affine=affine)


class OPTDecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, LAYER_NORM_EPS,
                         "sequential" if config.do_layer_norm_before else "post-norm", layer_norm(config))


def projection(config: PretrainedConfig, input_size: int, output_size: int) -> ReplicatedLinear | None:
    """project_in / project_out: replicated (no bias), only where word_embed_proj_dim differs from hidden_size."""
    return ReplicatedLinear(input_size, output_size) if config.word_embed_proj_dim != config.hidden_size else None


class OPTModel(GPT2Model):
    decoder_layer = OPTDecoderLayer
    position_offset = 2

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.project_in = projection(config, config.word_embed_proj_dim, config.hidden_size)
        self.project_out = projection(config, config.hidden_size, config.word_embed_proj_dim)

    @staticmethod
    def token_embedding(config: PretrainedConfig) -> nn.Module:
        return VocabParallelEmbedding(config.vocab_size, config.word_embed_proj_dim)

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        if config.do_layer_norm_before and not config._remove_final_layer_norm:
            return layer_norm(config)(config.hidden_size, LAYER_NORM_EPS)
        return ResidualSum()

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return self.add_positions(x if self.project_in is None else self.project_in(x), positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        """Hidden states word_embed_proj_dim wide, what the LM head takes."""
        x = super().forward(input_ids, positions, meta)
        return x if self.project_out is None else self.project_out(x)


class OPTForCausalLM(LlamaForCausalLM):
    model_class = OPTModel
    # transformers' files name the decoder `model.decoder.*`, older Hub files (OPTModel's) `decoder.*`.
    weight_name_substitutions = {
        "^decoder.": "model.decoder.",
        "^model.decoder.final_layer_norm.": "model.norm.",
        "^model.decoder.embed_positions.": "model.wpe.",
        "^model.decoder.": "model.",
        ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".self_attn_layer_norm.": ".input_layernorm.",
        ".final_layer_norm.": ".post_attention_layernorm.",
        ".fc1.": ".mlp.fc1.",
        ".fc2.": ".mlp.fc2.",
    }

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.enable_bias, o_bias=config.enable_bias, rope=False)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, config.enable_bias, config.ffn_dim, config.activation_function)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        if not config.tie_word_embeddings and self.model.project_out is not None:  # the LM head takes the projection
            self.lm_head = type(self.lm_head)(config.vocab_size, config.word_embed_proj_dim)
