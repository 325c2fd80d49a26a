"""CodeGen (Salesforce's CodeGen 1 and 2): GPT-J's layer (one LayerNorm feeding the attention and the MLP in parallel,
interleaved rope over the leading `rotary_dim` dims of each head, a dense "gelu_new" MLP fc_in / fc_out with biases,
an LM head with a bias), its q/k/v stored fused in `qkv_proj` as laid out for 4-way model parallelism: regrouped into
q, k, v on load."""
import torch
from transformers import PretrainedConfig

from nanoinfer.layers.linear import RegroupedQKVLinear
from nanoinfer.models.gptj import GPTJBlock, GPTJForCausalLM, GPTJModel
from nanoinfer.models.llama import LlamaAttention

MP_NUM = 4  # transformers' CodeGenAttention hardcodes mp_num = 4


class CodeGenQKVLinear(RegroupedQKVLinear):
    """qkv_proj's rows in MP_NUM groups, each holding a quarter of the heads' queries, then their values, then their
    keys (in that order): head h is row block h % (heads / MP_NUM) of group h // (heads / MP_NUM)."""

    def parts(self, loaded: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        groups = loaded.reshape(MP_NUM, 3, -1, *loaded.shape[1:])
        return [("q", groups[:, 0]), ("v", groups[:, 1]), ("k", groups[:, 2])]


class CodeGenAttention(LlamaAttention):
    qkv_class = CodeGenQKVLinear


class CodeGenBlock(GPTJBlock):
    attention_class = CodeGenAttention


class CodeGenModel(GPTJModel):
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
    # The Hub's files also hold the attention's causal-mask buffer.
    ignored_weight_suffixes = (".attn.causal_mask",)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
