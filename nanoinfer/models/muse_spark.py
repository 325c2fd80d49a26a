"""Muse Spark's language model (`muse_spark_text`, run text only under MuseSparkForConditionalGeneration): Muse
Glimmer's (muse_glimmer.py: attention, embeddings, final norm, logits, placeholder ids) with each head's attention
output RMS-normed without a weight before the gate, (1 + weight) norms whose 1 + weight rounds to the model's dtype, and
sublayers that join the residual stream through learned gates (alpha * residual + beta * output, from a per-channel
gate over `residual_gate_temperature`), the attention's output normed without a weight first, the MLP's scaled by
(1 + weight) and then normed; MLPs dense or, as `mlp_layer_types` says, a MoE at `moe_hidden_size` (projected down and
normed first, back up after), each chosen expert's output normed as the MLP's is, the experts chosen by the sigmoid of
the fp32 router logits times `output_multiplier` plus a correction bias, renormalized, times `routed_scaling_factor`."""
import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.fused_moe import FusedMoE, fused_experts, select_experts_sigmoid_biased
from nanoinfer.layers.layernorm import GemmaRMSNorm, WeightlessRMSNorm, rms_normalize
from nanoinfer.layers.linear import ReplicatedLinear, copy_weight
from nanoinfer.models.deepseek_v2 import DeepseekRouter
from nanoinfer.models.deepseek_v3 import mlp_layer_type
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP
from nanoinfer.models.muse_glimmer import MuseGlimmerModel, MuseGlimmerTextForCausalLM


class SparkRMSNorm(GemmaRMSNorm):
    """x / rms(x) * (1 + w), 1 + w rounded to the model's dtype (transformers' MuseSparkTextCenteredRMSNorm)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param, (loaded[...].to(self.model_dtype) + 1.0).float())


class InputScaledRMSNorm(SparkRMSNorm):
    """x * (1 + w) rounded to x's dtype, then RMS-normed (transformers' MuseSparkTextInputScaledRMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize((x.float() * self.weight).to(x.dtype), self.eps)


class ResidualGate(nn.Module):
    """alpha * residual + beta * x in fp32, rounded to the residual's dtype: beta = sigmoid(w), alpha =
    sqrt(max(sigmoid(-w) * (1 + beta), 1e-3)), w the fp32 gate over the temperature."""

    def __init__(self, hidden_size: int, temperature: float):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(hidden_size, dtype=torch.float32), requires_grad=False)
        self.temperature = temperature

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        w = self.gate / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=1e-3))
        return (alpha * residual + beta * x).to(residual.dtype)


class HeadNormedAttention(Attention):
    """Each head's output RMS-normed without a weight (the attention's `o_norm`; eps set by MuseSparkAttention)."""
    eps: float

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        o = super().forward(q, k, v, meta)
        return rms_normalize(o.reshape(-1, self.num_heads, self.head_dim), self.eps).flatten(1)


class MuseSparkAttention(LlamaAttention):
    attn_class = HeadNormedAttention

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(config, options)
        self.attn.eps = config.rms_norm_eps


class MuseSparkExperts(FusedMoE):
    """Experts at moe_hidden_size; each (token, expert) output is normed (InputScaledRMSNorm, one weight for all
    experts) before its routing weight scales it."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config.num_local_experts, config.num_experts_per_tok, config.moe_hidden_size,
                         config.moe_intermediate_size, renormalize=False)
        self.post_expert_norm = InputScaledRMSNorm(config.moe_hidden_size, config.post_norm_eps)

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, expert_norm=self.normalize)

    def normalize(self, y: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each pair's output, summed over the ranks' slices of the experts first (the norm needs all of it)."""
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return self.post_expert_norm(y)


class MuseSparkMoE(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        self.top_k, self.scaling = config.num_experts_per_tok, config.routed_scaling_factor
        self.logit_multiplier = config.output_multiplier
        # The weight and correction bias fp32 in every dtype, as transformers keeps them.
        self.gate = DeepseekRouter(config, True, config.num_local_experts, fp32_weight=True)
        self.pre_expert_proj = ReplicatedLinear(config.hidden_size, config.moe_hidden_size)
        self.pre_expert_norm = SparkRMSNorm(config.moe_hidden_size, config.rms_norm_eps)
        self.experts = MuseSparkExperts(config)
        self.post_expert_proj = ReplicatedLinear(config.moe_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_sigmoid_biased(self.gate(x) * self.logit_multiplier, self.top_k,
                                                     self.gate.e_score_correction_bias, 1, 1, True, self.scaling)
        y = self.experts.run_experts(self.pre_expert_norm(self.pre_expert_proj(x)), weights, ids)
        return self.post_expert_proj(y)


class MuseSparkDecoderLayer(nn.Module):
    """Called as (positions, x, meta) -> x: the gated residual stream has no separate residual."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__()
        hidden, eps, post_eps = config.hidden_size, config.rms_norm_eps, config.post_norm_eps
        self.self_attn = MuseSparkAttention(config, options)
        self.mlp = mlp
        self.input_layernorm = SparkRMSNorm(hidden, eps)
        self.post_attention_layernorm = WeightlessRMSNorm(hidden, post_eps)
        self.pre_feedforward_layernorm = SparkRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = InputScaledRMSNorm(hidden, post_eps)
        self.post_attention_residual_gate = ResidualGate(hidden, config.residual_gate_temperature)
        self.post_feedforward_residual_gate = ResidualGate(hidden, config.residual_gate_temperature)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        x = self.post_attention_residual_gate(x, h)
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return self.post_feedforward_residual_gate(x, h)


class MuseSparkModel(MuseGlimmerModel):
    decoder_layer = MuseSparkDecoderLayer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        x = self.embed(input_ids, positions)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class MuseSparkTextForCausalLM(MuseGlimmerTextForCausalLM):
    model_class = MuseSparkModel

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return MuseSparkMoE(config) if mlp_layer_type(config, layer_idx) == "sparse" else LlamaMLP(config)
