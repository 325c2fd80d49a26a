"""ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`, e.g. ERNIE-4.5-21B-A3B): the Llama decoder with optional biases on every
projection (`use_bias`), rope in the interleaved layout; MLPs from `moe_layer_start_index` to `moe_layer_end_index`
(every `moe_layer_interval`-th) are routed experts plus ungated shared experts, the others dense. Also ERNIE 4.5 VL's
language model, on text: its text experts alone."""
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE, Fp32Router
from nanoinfer.models.config_checks import check_each_in
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP


def select_experts_softmax_biased(router_logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor,
                                  norm_min: float | None, scaling: float = 1.0, sorted_topk: bool = True
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """ERNIE's router: fp32 softmax over all experts; the choice is the top k of probability + correction_bias, the
    weights the chosen probabilities divided by their sum (at least norm_min). LongCat-Flash's: not renormalized
    (norm_min None), times `scaling`, the top k in torch.topk's unsorted order (as its router takes them)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    ids = torch.topk(probs + correction_bias, top_k, dim=-1, sorted=sorted_topk)[1]
    weights = probs.gather(1, ids)
    if norm_min is not None:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=norm_min)
    return weights * scaling, ids


class Ernie4_5_MoeStatics(nn.Module):
    """Holds the checkpoint's `moe_statics.e_score_correction_bias` [1, experts] (one row: one expert group)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.empty(1, num_experts, dtype=torch.float32),
                                                    requires_grad=False)


class Ernie4_5_MoeSparseMoeBlock(nn.Module):
    """A replicated router (`gate`), the routed experts (FusedMoE, each rank a slice of every expert) and
    `moe_num_shared_experts` shared experts as one MLP every token passes through, added ungated; experts (and the
    shared experts' unit) `intermediate_size` wide."""

    def __init__(self, config: PretrainedConfig, intermediate_size: int):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        self.top_k, self.norm_min = config.num_experts_per_tok, config.moe_norm_min
        # The router and the statics stay in fp32 in every model dtype, as transformers keeps them.
        self.gate = Fp32Router(config.hidden_size, config.num_experts, fp32_weight=True)
        self.moe_statics = Ernie4_5_MoeStatics(config.num_experts)
        self.experts = FusedMoE(config.num_experts, self.top_k, config.hidden_size, intermediate_size,
                                renormalize=False)  # routed by select_experts_softmax_biased, not by FusedMoE
        shared = config.moe_num_shared_experts or 0
        self.shared_experts = LlamaMLP(config, intermediate_size * shared, bias=config.use_bias) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_softmax_biased(self.gate(x), self.top_k,
                                                     self.moe_statics.e_score_correction_bias[0], self.norm_min)
        y = self.experts.run_experts(x, weights.to(x.dtype), ids)
        return y if self.shared_experts is None else y + self.shared_experts(x)


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether a layer's MLP is routed experts, exactly as transformers decides it."""
    return ((layer_idx + 1) % config.moe_layer_interval == 0
            and config.moe_layer_start_index <= layer_idx <= config.moe_layer_end_index)


class Ernie4_5_MoeForCausalLM(LlamaForCausalLM):
    # transformers' name for the statics (it renames the checkpoints' `mlp.moe_statics.` on load): either loads.
    weight_name_substitutions = {".mlp.gate.moe_statics.": ".mlp.moe_statics."}

    def __init__(self, config: PretrainedConfig):
        self.lm_head_bias = config.use_bias  # the LM head has a bias too; read by LlamaForCausalLM.__init__
        super().__init__(config)

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.use_bias, o_bias=config.use_bias, rope_interleaved=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Ernie4_5_MoeSparseMoeBlock(config, config.moe_intermediate_size)
        return LlamaMLP(config, bias=config.use_bias)


# A checkpoint's routed expert, by its index (the Hub's ERNIE 4.5 VL files number the text experts, then the vision
# ones, in one list).
_EXPERT_INDEX = re.compile(r"\.mlp\.experts\.(\d+)\.")


class Ernie4_5_VLMoeLanguageModel(Ernie4_5_MoeForCausalLM):
    """The language model of ERNIE 4.5 VL (`Ernie4_5_VLMoeForConditionalGeneration`, see vision_language.py): ERNIE
    4.5 MoE's layers, sparse where `mlp_layer_types` says, with modality-isolated experts. Besides the shared experts,
    text tokens reach only the text experts (their own router and correction bias; moe_intermediate_size[0] wide, as
    the shared experts' unit): those alone are built, the vision experts skipped. The wrapper's LM head has no bias.
    The Hub's files (what transformers saves) hold each layer's routers as [hidden, experts] (the text one
    `gate.weight`, the vision one `gate.weight_1`), both correction biases as the rows of one
    `moe_statics.e_score_correction_bias`, and the experts one by one, the vision ones after the text ones."""

    def __init__(self, config: PretrainedConfig):
        check_each_in(config, "mlp_layer_types", ("dense", "sparse"))
        LlamaForCausalLM.__init__(self, config)  # (not ERNIE 4.5 MoE's: its LM head's bias is use_bias)
        self.num_text_experts = config.num_experts

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if config.mlp_layer_types[layer_idx] == "sparse":
            return Ernie4_5_MoeSparseMoeBlock(config, config.moe_intermediate_size[0])
        return LlamaMLP(config, bias=config.use_bias)

    def convert_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors less the vision experts and their router; the text router as [experts, hidden],
        the text experts' correction bias (the first row)."""
        for name, tensor in weights:
            if (m := _EXPERT_INDEX.search(name)) and int(m.group(1)) >= self.num_text_experts:
                continue
            if name.endswith(".mlp.gate.weight_1"):
                continue
            if name.endswith(".mlp.gate.weight"):
                tensor = tensor.t()
            elif name.endswith(".mlp.moe_statics.e_score_correction_bias"):
                tensor = tensor[:1]
            yield name, tensor
