"""CodeGen (Salesforce's CodeGen 1 and 2): GPT-J's layer (one LayerNorm feeding the attention and the MLP in parallel,
interleaved rope over the leading `rotary_dim` dims of each head, a dense "gelu_new" MLP fc_in / fc_out with biases,
an LM head with a bias), its q/k/v stored fused in `qkv_proj` as laid out for 4-way model parallelism: regrouped into
q, k, v on load."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.linear import QKVParallelLinear
from nanoinfer.models.gptj import GPTJForCausalLM
from nanoinfer.models.layernorm_decoder import LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaAttention

MP_NUM = 4  # transformers' CodeGenAttention hardcodes mp_num = 4


class CodeGenQKVLinear(QKVParallelLinear):
    """qkv_proj's rows in MP_NUM groups, each holding a quarter of the heads' queries, then their values, then their
    keys (in that order): head h is row block h % (heads / MP_NUM) of group h // (heads / MP_NUM)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows, rest = 3 * self.total_num_heads * self.head_size, loaded.shape[1:]
        if loaded.shape[0] != rows:
            raise ValueError(f"shape mismatch: checkpoint tensor has {loaded.shape[0]} rows, expected {rows} "
                             f"(3 x {self.total_num_heads} heads x {self.head_size})")
        groups = loaded[...].reshape(MP_NUM, 3, -1, *rest)
        for shard_id, part in (("q", groups[:, 0]), ("v", groups[:, 1]), ("k", groups[:, 2])):
            super().weight_loader(param, part.reshape(-1, *rest), shard_id)


class CodeGenAttention(LlamaAttention):
    qkv_class = CodeGenQKVLinear


class CodeGenBlock(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(CodeGenAttention(config, options), mlp, config.hidden_size, config.layer_norm_epsilon,
                         "parallel-one-norm")


class CodeGenModel(LayerNormModel):
    decoder_layer = CodeGenBlock


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    if config.n_head % MP_NUM:
        raise ValueError(f"n_head={config.n_head} in the model config: {config.model_type}'s qkv_proj layout needs "
                         f"a multiple of {MP_NUM}")


class CodeGenForCausalLM(GPTJForCausalLM):
    model_class = CodeGenModel
    packed_modules_mapping = {}  # qkv_proj holds q, v and k interleaved: its layer's weight_loader splits them
    check_config = staticmethod(check_config)
    # The Hub's files also hold the attention's causal-mask buffers.
    ignored_weight_suffixes = (".attn.causal_mask", ".attn.bias", ".attn.masked_bias")

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
