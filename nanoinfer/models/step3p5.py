"""Step-3.5's language model (`step3p5`, run text only under Step3p7ForConditionalGeneration): pre-norm layers of
(1 + weight) RMSNorms; attention with per-head (1 + weight) q/k norms before the rope, a rope per layer type (its own
base and `partial_rotary_factor`), scores scaled by `query_pre_attn_scalar` ** -0.5, the sliding layers' own query head
count (`num_sliding_attention_heads`, a per-layer config) and window, the output gated by sigmoid(g_proj(x)) per head
or per element (`gating`); MLPs dense or, as `mlp_layer_types` says, experts chosen by sigmoid scores plus a correction
bias (the router in the model's dtype), renormalized, their sum times `moe_router_scaling_factor`, plus a shared
expert. A layer's SwiGLUs clamp where its `swiglu_limits` (routed experts) or `swiglu_limits_shared` (shared expert
and dense MLP) entry is set: the gate after the SiLU from above, the up projection on both sides."""
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import GatedActivation, silu_and_mul
from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.deepseek_v3 import UngroupedSigmoidMoE, mlp_layer_type, mtp_layer_prefixes
from nanoinfer.models.gemma import GemmaDecoderLayer
from nanoinfer.models.gemma2 import check_layer_types
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaModel, layer_sliding_window
from nanoinfer.models.minimax_m3 import MiniMaxM3MLP

_GATINGS = (True, "per-head", "per-element")
# The Hub's MoE names (which transformers' save_pretrained writes back); its stacked experts are split by
# Step3p5ForCausalLM.convert_checkpoint.
HUB_NAMES = {".moe.gate.weight": ".mlp.gate.weight", ".moe.router_bias": ".mlp.gate.e_score_correction_bias",
             ".share_expert.": ".mlp.shared_experts."}
HUB_EXPERTS = (".moe.gate_proj.weight", ".moe.up_proj.weight", ".moe.down_proj.weight")  # [experts, out, in] each


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    where = config_source(config)
    if config.gating not in _GATINGS:  # transformers gates per element on anything but True and "per-head"
        raise ValueError(f"gating={config.gating!r} in {where} is not supported; expected one of {_GATINGS}")
    for name in ("use_bidirectional_attention", "mlp_bias"):
        if getattr(config, name, False):
            raise ValueError(f"{name}={getattr(config, name)!r} in {where} is not supported")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} in {where} is not supported; only 'silu' is")
    check_layer_types(config)


def swiglu(limits: list[float | None] | None, layer_idx: int) -> GatedActivation:
    """transformers' Step3p7 SwiGLU on layer layer_idx: silu(gate) clamped from above and up on both sides to the
    layer's entry of `limits`, unless there is none or it is 0 or None."""
    limit = limits[layer_idx] if limits else None
    if not limit:
        return silu_and_mul

    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
    return activation


class Step3p5MoE(UngroupedSigmoidMoE):
    """As transformers' Step3p7SparseMoeBlock: the router's logits and correction bias in the model's dtype, the top k
    unsorted, the routed experts' sum (not the weights) times `moe_router_scaling_factor`."""
    router_in_model_dtype = True
    fp32_router_weight = False
    sorted_topk = False

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__(config, config.n_routed_experts, 0, activation=swiglu(config.swiglu_limits, layer_idx))
        self.shared_experts = MiniMaxM3MLP(config, config.share_expert_dim,
                                           swiglu(config.swiglu_limits_shared, layer_idx))
        self.routed_scaling = config.moe_router_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *self.select_experts(x)) * self.routed_scaling + self.shared_experts(x)


class Step3p5Model(LlamaModel):
    decoder_layer = GemmaDecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Step3p5ForCausalLM(LlamaForCausalLM):
    model_class = Step3p5Model
    weight_name_substitutions = HUB_NAMES

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_class=GemmaRMSNorm,
                                scale=config.query_pre_attn_scalar ** -0.5,
                                sliding_window=layer_sliding_window(config, layer_idx),
                                rope_layer_type=config.layer_types[layer_idx], gate_activation=torch.sigmoid,
                                gate_per_head=config.gating != "per-element",
                                num_heads=config.per_layer_config[layer_idx].num_attention_heads)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if mlp_layer_type(config, layer_idx) == "sparse":
            return Step3p5MoE(config, layer_idx)
        return MiniMaxM3MLP(config, config.intermediate_size, swiglu(config.swiglu_limits_shared, layer_idx))

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
        self.ignored_weight_prefixes = mtp_layer_prefixes(config)

    @staticmethod
    def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, the Hub's stacked expert projections split into per-expert ones."""
        for name, tensor in weights:
            if not name.endswith(HUB_EXPERTS):
                yield name, tensor
                continue
            stem, _, proj = name.removesuffix(".weight").rpartition(".moe.")
            for expert in range(tensor.shape[0]):
                yield f"{stem}.mlp.experts.{expert}.{proj}.weight", tensor[expert]
