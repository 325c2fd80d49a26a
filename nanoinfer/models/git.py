"""GIT (GitForCausalLM) on text alone: its BERT-style text decoder, word + learned absolute position embeddings and
their LayerNorm, then BERT's post-norm layers (h = ln1(x + attn(x)); out = ln2(h + mlp(h)), biases everywhere, a
dense MLP of the config's `hidden_act`) under a causal mask, no final norm, an untied LM head (`output`) with a
bias. transformers puts the image's tokens before the text's only when pixel values come; without them its decoder
is this causal LM, positions from 0. The image encoder and its projection are not loaded."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.models.gpt2 import GPT2Model, biased_attention
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, ResidualSum
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, MLPFactory, OptionsFactory


class GitLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, config.layer_norm_eps, "post-norm")


class GitModel(GPT2Model):
    decoder_layer = GitLayer

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.embeddings_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return ResidualSum()

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.embeddings_layernorm(super().embed(input_ids, positions))


class GitForCausalLM(LlamaForCausalLM):
    model_class = GitModel
    lm_head_bias = True
    # transformers' names: the text decoder in BERT's layout under `git.`, the LM head `output`.
    weight_name_substitutions = {
        "^git.embeddings.word_embeddings.": "model.embed_tokens.",
        "^git.embeddings.position_embeddings.": "model.wpe.",
        "^git.embeddings.LayerNorm.": "model.embeddings_layernorm.",
        "^git.encoder.layer.": "model.layers.",
        "^output.": "lm_head.",
        ".attention.self.query.": ".self_attn.q_proj.",
        ".attention.self.key.": ".self_attn.k_proj.",
        ".attention.self.value.": ".self_attn.v_proj.",
        ".attention.output.dense.": ".self_attn.o_proj.",
        ".attention.output.LayerNorm.": ".input_layernorm.",
        ".intermediate.dense.": ".mlp.fc1.",
        ".output.dense.": ".mlp.fc2.",
        ".output.LayerNorm.": ".post_attention_layernorm.",
    }
    # The image side: its CLIP-style encoder, the projection of its features and a video's per-frame embeddings.
    ignored_weight_prefixes = ("git.image_encoder.", "git.visual_projection.", "git.img_temporal_embedding.")
    ignored_weight_suffixes = ("embeddings.position_ids",)  # the Hub's files keep the position ids buffer

    attention_options = staticmethod(biased_attention)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True)
