"""Llama 4 (Scout, Maverick) as text: the Llama decoder with interleaved rope and a weightless q/k norm after it on
most layers, NoPE layers (`no_rope_layers` 0) whose queries are scaled by a position-dependent temperature instead,
and, on `moe_layers`, routed experts plus a shared expert (dense layers: `intermediate_size_mlp` wide). The rope
layers' attention is chunked (`attention_chunk_size`): a query sees only the keys of its own chunk."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE, select_experts_sigmoid_topk
from nanoinfer.layers.layernorm import WeightlessRMSNorm
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP, llama4_query_scale
from nanoinfer.models.registry import chunked_attention_size


class Llama4MoE(nn.Module):
    """transformers' Llama4TextMoe: each token's top k experts by router logit, whose sigmoids scale the experts'
    input (not their output), plus a shared expert every token passes through. Each rank holds a slice of every
    expert's and the shared expert's intermediate dimension, and the whole router."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts)
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=False, apply_router_weight_on_input=True,
                                stacked_transposed=True)  # transformers' Llama4TextExperts: [experts, in, out]
        self.shared_expert = LlamaMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_sigmoid_topk(self.router(x), self.experts.top_k)
        return self.experts.run_experts(x, weights, ids) + self.shared_expert(x)


class Llama4ForCausalLM(LlamaForCausalLM):
    # transformers names a layer's MLP (dense or MoE) `feed_forward`; ours, as the Llama decoder's, is `mlp`.
    weight_name_substitutions = {".feed_forward.": ".mlp."}

    @staticmethod
    def check_config(config: PretrainedConfig) -> None:
        """What this implementation cannot do, refused by name rather than run differently from transformers."""
        if config.hidden_act != "silu":  # FusedMoE's experts
            raise ValueError(f"hidden_act={config.hidden_act!r} in the model config: only 'silu' is implemented")

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        rope = bool(config.no_rope_layers[layer_idx])  # 1: the layer uses rope (transformers' naming)
        bias = config.attention_bias
        # HF checkpoints keep Meta's q/k layout: rope rotates the pairs (x0, x1), (x2, x3), ... (complex numbers).
        tuned = config.attn_temperature_tuning and not rope
        temperature = llama4_query_scale(config.floor_scale, config.attn_scale, 1.0) if tuned else None
        return AttentionOptions(qkv_bias=bias, o_bias=bias, rope=rope, rope_interleaved=True,
                                qk_norm=config.use_qk_norm and rope, qk_norm_after_rope=True,
                                qk_norm_class=WeightlessRMSNorm, query_scale=temperature,
                                attention_chunk_size=chunked_attention_size(config, layer_idx))

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if layer_idx in config.moe_layers:
            return Llama4MoE(config)
        return LlamaMLP(config, config.intermediate_size_mlp)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
