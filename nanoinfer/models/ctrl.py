"""CTRL: GPT-2's pre-norm decoder on fixed sinusoidal positions (sines then cosines of position / 10000 ** (2j / d),
computed, not in the checkpoint) added to token embeddings scaled by sqrt(hidden_size); separate q/k/v projections
(Wq, Wk, Wv, dense) with biases, a ReLU MLP `dff` wide with biases, every layer's LayerNorms at a fixed 1e-6 (the
config's `layer_norm_epsilon` is the final norm's alone), a tied LM head with a bias."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.gpt2 import GPT2Model, biased_attention
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM
from nanoinfer.models.xglm import SinusoidalPositions

LAYER_NORM_EPS = 1e-6  # transformers' EncoderLayer hard-codes it


def ctrl_sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """transformers' CTRL positional_encoding, [num_positions, dim], op for op in fp32: dims 2j and 2j + 1 share the
    angle position / 10000 ** (2j / dim); the sines of the even dims, then the cosines of the odd ones."""
    positions = torch.arange(num_positions, dtype=torch.float32)[:, None]
    dims = torch.arange(dim, dtype=torch.float32)[None, :]
    angles = positions * (1 / torch.pow(10000, (2 * (dims // 2)) / dim))
    return torch.cat([torch.sin(angles[:, 0::2]), torch.cos(angles[:, 1::2])], dim=-1)


class CTRLLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, LAYER_NORM_EPS)


class CTRLModel(GPT2Model):
    decoder_layer = CTRLLayer

    @staticmethod
    def embedding_scale(config: PretrainedConfig) -> float:
        return config.hidden_size ** 0.5

    def position_embedding(self, config: PretrainedConfig) -> nn.Module:
        return SinusoidalPositions(ctrl_sinusoidal_table(config.max_position_embeddings, config.hidden_size))


class CTRLLMHeadModel(LlamaForCausalLM):
    model_class = CTRLModel
    lm_head_bias = True
    weight_name_substitutions = {
        "^transformer.w.": "model.embed_tokens.",
        "^transformer.layernorm.": "model.norm.",
        "^transformer.h.": "model.layers.",
        ".multi_head_attention.": ".self_attn.",
        ".self_attn.Wq.": ".self_attn.q_proj.",
        ".self_attn.Wk.": ".self_attn.k_proj.",
        ".self_attn.Wv.": ".self_attn.v_proj.",
        ".self_attn.dense.": ".self_attn.o_proj.",
        ".layernorm1.": ".input_layernorm.",
        ".layernorm2.": ".post_attention_layernorm.",
        ".ffn.0.": ".mlp.fc1.",
        ".ffn.2.": ".mlp.fc2.",
        "^classifier.": "score.",  # CTRLForSequenceClassification's head (classification.py's `score`)
    }

    attention_options = staticmethod(biased_attention)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True, config.dff, "relu")
