"""Arcee (AFM): Llama with a non-gated MLP, down(relu(up(x)) ** 2) ("relu2"), biases on it where `mlp_bias`; also
Cosmos3 Edge's reasoner (`cosmos3_edge_text`, its checkpoint names in vision_language.py)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.layernorm_decoder import DenseMLP
from nanoinfer.models.llama import LlamaForCausalLM

# The dense MLP's names (its up / down projections are Llama's, not merged with a gate).
DENSE_MLP_NAMES = {".mlp.up_proj.": ".mlp.fc1.", ".mlp.down_proj.": ".mlp.fc2."}


class ArceeForCausalLM(LlamaForCausalLM):
    weight_name_substitutions = DENSE_MLP_NAMES

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, config.mlp_bias)

