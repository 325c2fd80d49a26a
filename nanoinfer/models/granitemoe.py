"""IBM Granite MoE (GraniteMoe; GraniteMoeShared adds a shared expert): Granite's multipliers around top-k routed
experts, each token's weights a softmax over its k router logits. Checkpoints stack every expert in one tensor."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import SparseMoeBlock, select_experts_topk_softmax
from nanoinfer.models.granite import SINKS_SUBSTITUTION, GraniteForCausalLM, swa_attention_options
from nanoinfer.models.llama import LlamaMLP


class GraniteMoeBlock(SparseMoeBlock):
    def __init__(self, config: PretrainedConfig):
        # renormalize=False: FusedMoE.forward's softmax routing is not used, select_experts_topk_softmax routes.
        super().__init__(config, config.num_local_experts, config.intermediate_size, renormalize=False)
        shared = getattr(config, "shared_intermediate_size", 0)  # GraniteMoeShared: every token through it, ungated
        self.shared_mlp = LlamaMLP(config, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts.run_experts(x, *select_experts_topk_softmax(self.gate(x), self.experts.top_k))
        return y if self.shared_mlp is None else y + self.shared_mlp(x)


class GraniteMoeForCausalLM(GraniteForCausalLM):
    # The checkpoints' names: experts stacked as `input_linear` [experts, 2 * inter, hidden] (gate rows, then up
    # rows) and `output_linear` [experts, hidden, inter], the router `router.layer`, the shared expert's fused
    # gate/up `input_linear` beside the MoE (`shared_mlp`); here all of it is the layer's `mlp`.
    weight_name_substitutions = {
        ".block_sparse_moe.input_linear.weight": ".mlp.experts.gate_up_proj",
        ".block_sparse_moe.output_linear.weight": ".mlp.experts.down_proj",
        ".block_sparse_moe.router.layer.": ".mlp.gate.",
        ".shared_mlp.input_linear.": ".mlp.shared_mlp.gate_up_proj.",
        ".shared_mlp.output_linear.": ".mlp.shared_mlp.down_proj.",
    }

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return GraniteMoeBlock(config)


class GraniteMoeSWAForCausalLM(GraniteMoeForCausalLM):
    # transformers saves its experts in its own stacked layout under `block_sparse_moe`, the router as `router`.
    weight_name_substitutions = (GraniteMoeForCausalLM.weight_name_substitutions | SINKS_SUBSTITUTION
                                 | {".block_sparse_moe.router.": ".mlp.gate.",
                                    ".block_sparse_moe.experts.": ".mlp.experts."})
    attention_options = staticmethod(swa_attention_options)
