"""Mixtral: the Mistral decoder (a sliding window on every layer, where the config sets one) whose MLP is, on every
layer, each token's top k of `num_local_experts` routed experts, their weights renormalized to sum to 1."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import SparseMoeBlock
from nanoinfer.models.mistral import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    # Checkpoints (the Hub's and transformers' save_pretrained) name the MoE `block_sparse_moe`, the experts'
    # gate/up/down `w1`/`w3`/`w2` (see fused_moe.expert_weight_target); transformers' module, as ours, is `mlp`.
    weight_name_substitutions = {".block_sparse_moe.": ".mlp."}

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        # Router jitter and the auxiliary loss are training-only: inference routes on the plain router logits.
        # transformers' Mixtral router leaves its weights in fp32 (Qwen's round them to the model's dtype).
        return SparseMoeBlock(config, config.num_local_experts, config.intermediate_size, renormalize=True,
                              fp32_weights=True)
