"""OpenAI GPT (GPT-1): GPT-2's layout (learned positions, Conv1D weights with q/k/v fused in `c_attn`, biases, an MLP
4 x hidden_size wide, a tied LM head) in post-norm layers, h = ln_1(x + attn(x)); out = ln_2(h + mlp(h)), with no
final norm; the MLP's activation `afn`, whose "gelu" is transformers' tanh approximation ("gelu_new")."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.config_checks import config_source
from nanoinfer.models.gpt2 import GPT2Block, GPT2LMHeadModel, GPT2MLP, GPT2Model, biased_attention
from nanoinfer.models.layernorm_decoder import ResidualSum

# transformers' ACT_FNS of modeling_openai.py, by the names of nanoinfer's activations.
ACTIVATIONS = {"relu": "relu", "silu": "silu", "swish": "silu", "gelu": "gelu_new"}


class OpenAIGPTBlock(GPT2Block):
    residual = "post-norm"


class OpenAIGPTModel(GPT2Model):
    decoder_layer = OpenAIGPTBlock

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return ResidualSum()


def check_config(config: PretrainedConfig) -> None:
    if config.afn not in ACTIVATIONS:
        raise ValueError(f"afn={config.afn!r} in {config_source(config)} is not supported; expected one of "
                         f"{tuple(ACTIVATIONS)}")


class OpenAIGPTLMHeadModel(GPT2LMHeadModel):
    model_class = OpenAIGPTModel
    check_config = staticmethod(check_config)
    # transformers' files name the decoder `transformer.*`, the Hub's original ones (OpenAIGPTModel's) leave it out.
    weight_name_substitutions = {"^transformer.": "", "^tokens_embed.": "model.embed_tokens.",
                                 "^positions_embed.": "model.wpe.", **GPT2LMHeadModel.weight_name_substitutions}

    attention_options = staticmethod(biased_attention)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return GPT2MLP(config, True, 4 * config.hidden_size, ACTIVATIONS[config.afn])
