"""Kosmos-2.5's language model (Kosmos2_5ForConditionalGeneration on text alone): XGLM's pre-norm decoder (biases
everywhere, token embeddings times sqrt(hidden_size) where `scale_embedding`, fairseq's sinusoidal positions) whose
position rows start at pad_token_id + 1, a pad token taking the zeroed row pad_token_id, plus row 0 of its segment
embedding (`segment_emb`, the text segment's) on every token; the MLP fc2(ln(act(fc1(x)))) with a LayerNorm
(`ffn_layernorm`) over its activations, a final LayerNorm, a tied LM head. transformers numbers a prompt's tokens past
its pad tokens by the non-pad ones alone (its decoding steps count them all): here each takes its position in the
sequence, the same wherever a prompt holds no pad token. The vision model and its projection are not loaded."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import ShardedLayerNorm
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.gpt2 import GPT2Model, biased_attention
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, MLPFactory, OptionsFactory
from nanoinfer.models.xglm import SinusoidalPositions, sinusoidal_table


class SubLayerNormMLP(DenseMLP):
    """fc2(ffn_layernorm(act(fc1(x)))): the norm spans fc1's output, split across the ranks as fc2's input."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, True, config.ffn_dim, config.activation_function)
        self.ffn_layernorm = ShardedLayerNorm(config.ffn_dim, config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ffn_layernorm(self.act(self.fc1(x))))


class Kosmos2_5TextBlock(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, config.layer_norm_eps)


class Kosmos2_5TextModel(GPT2Model):
    decoder_layer = Kosmos2_5TextBlock

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.segment_emb = nn.Embedding(2, config.hidden_size)
        self.segment_emb.weight.requires_grad_(False)
        self.pad_token_id = config.pad_token_id

    @staticmethod
    def embedding_scale(config: PretrainedConfig) -> float:
        return config.hidden_size ** 0.5 if config.scale_embedding else 1.0

    def position_embedding(self, config: PretrainedConfig) -> nn.Module:
        self.position_offset = config.pad_token_id + 1
        return SinusoidalPositions(sinusoidal_table(config.max_position_embeddings + self.position_offset,
                                                    config.hidden_size, config.pad_token_id))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        if positions is None:  # an encoder pass: no position encoding
            return x
        rows = torch.where(input_ids == self.pad_token_id, self.pad_token_id, positions + self.position_offset)
        return x + (self.wpe(rows) + self.segment_emb.weight[0])


def check_config(config: PretrainedConfig) -> None:
    if config.pad_token_id is None:
        raise ValueError(f"pad_token_id=None in {config_source(config)} is not supported: Kosmos-2.5's positions "
                         f"count from it")


class Kosmos2_5TextForCausalLM(LlamaForCausalLM):
    model_class = Kosmos2_5TextModel
    # transformers' names (after the wrapper's `text_model.` prefix is taken off), fairseq's as XGLM's.
    weight_name_substitutions = {"^model.layer_norm.": "model.norm.", ".self_attn.out_proj.": ".self_attn.o_proj.",
                                 ".self_attn_layer_norm.": ".input_layernorm.",
                                 ".final_layer_norm.": ".post_attention_layernorm.", ".ffn.": ".mlp."}

    attention_options = staticmethod(biased_attention)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return SubLayerNormMLP(config)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
