"""Ergo (`ErgoForCausalLM`, Amazon's): a fused qkv_proj with per-head q/k norms and rope on interleaved pairs (angles in
fp64) on the sliding layers, the full ones NoPE with queries and keys scaled by sqrt(`global_attention_scale`);
Gemma 2's four norms per layer, each sublayer's output mixed into an fp32 residual stream by a learned gate per
dimension (16-bit models run only the sublayers in 16 bits); relu^2 MLPs, dense or, as `mlp_layer_types` says,
routed as DeepSeek-V3's are without groups (sigmoid + correction bias, renormalized, scaled), each expert's output
RMS-normed with its own weight, plus a shared expert with its own norm; an LM head with fp32 logits."""
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.fused_moe import FusedMoE, fused_experts, relu2, select_experts_sigmoid_biased
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.deepseek_v2 import DeepseekRouter, check_moe_config
from nanoinfer.models.deepseek_v3 import mlp_layer_type
from nanoinfer.models.gemma2 import Gemma2DecoderLayer, check_layer_types
from nanoinfer.models.gpt_oss import GptOssRMSNorm
from nanoinfer.models.layernorm_decoder import DenseMLP
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaModel


class ExpertRMSNorm(nn.Module):
    """transformers' ErgoExpertNorm: x / rms(x) in fp32 times its expert's weight (fp32 in every model dtype),
    rounded once."""

    def __init__(self, num_experts: int, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, y: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(y.float(), y.shape[-1:], eps=self.eps) * self.weight[expert_ids]).to(y.dtype)


class ErgoExperts(FusedMoE):
    """relu^2 experts without a gate, stacked [experts, in, out] in checkpoints; each (token, expert) output is
    normalized by its expert's norm before its routing weight scales it."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                         config.moe_intermediate_size, renormalize=False, activation=relu2, gated=False,
                         stacked_transposed=True)
        self.post_expert_norm = ExpertRMSNorm(config.num_experts, config.hidden_size, config.rms_norm_eps)

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, activation=self.activation,
                             expert_norm=self.normalize)

    def normalize(self, y: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each pair's output, summed over the ranks' slices of the experts first (the norm needs all of it)."""
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return self.post_expert_norm(y, expert_ids)


class ErgoSharedExpert(DenseMLP):
    """The expert every token goes through: a relu^2 MLP whose output is RMS-normed."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, False, config.shared_intermediate_size, "relu2")
        self.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


class ErgoMoE(nn.Module):
    """transformers' ErgoTopkRouter (fp32 logits of the weight in the model's dtype, as its linear rounds it to the
    input's; an fp32 correction bias; the top k unsorted) in front of ErgoExperts, plus the shared expert."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_moe_config(config, grouped=False)
        self.top_k, self.scaling = config.num_experts_per_tok, config.moe_routed_scaling_factor
        self.gate = DeepseekRouter(config, correction_bias=True, num_experts=config.num_experts)
        self.experts = ErgoExperts(config)
        self.shared_experts = ErgoSharedExpert(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_sigmoid_biased(self.gate(x), self.top_k, self.gate.e_score_correction_bias, 1,
                                                     1, True, self.scaling)
        # transformers rounds the routing weights to the model's dtype, then weighs the experts' outputs in fp32.
        return self.experts.run_experts(x, weights.to(x.dtype).float(), ids) + self.shared_experts(x)


class ResidualGate(nn.Module):
    """transformers' ErgoResidualGate, in fp32 (its weight w too): sigmoid(w) * out + sqrt(1 + sigmoid(w)) *
    exp(-softplus(w) / 2) * residual, its two terms returned apart (whatever reads the stream next sums them)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        branch = torch.sigmoid(self.weight)
        return branch * out, torch.sqrt(1.0 + branch) * torch.exp(-0.5 * F.softplus(self.weight)) * residual


class ErgoDecoderLayer(Gemma2DecoderLayer):
    """Norms before and after both sublayers (their weights applied in fp32); the residual stream stays fp32, each
    sublayer taking its input norm's output rounded to the model's dtype, and the gated adds go back to it in fp32."""

    norm_class = GptOssRMSNorm

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        self.attention_residual_gate = ResidualGate(config.hidden_size)
        self.feedforward_residual_gate = ResidualGate(config.hidden_size)
        self.branch_dtype = torch.get_default_dtype()  # the model's, as it is built

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else x + residual
        out = self.self_attn(positions, self.input_layernorm(h).to(self.branch_dtype), meta)
        out, h = self.attention_residual_gate(self.post_attention_layernorm(out.float()), h)
        h = out + h
        out = self.mlp(self.pre_feedforward_layernorm(h).to(self.branch_dtype))
        return self.feedforward_residual_gate(self.post_feedforward_layernorm(out.float()), h)


class ErgoModel(LlamaModel):
    decoder_layer = ErgoDecoderLayer

    @staticmethod
    def token_embedding(config: PretrainedConfig) -> nn.Module:
        return VocabParallelEmbedding(config.vocab_size, config.hidden_size, torch.float32)  # fp32 in every dtype

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot run, refused by name rather than run differently from transformers."""
    check_layer_types(config)
    head_dim, heads_width = getattr(config, "head_dim", None), config.hidden_size // config.num_attention_heads
    if head_dim not in (None, heads_width):  # transformers ignores it; the KV cache would be sized by it
        raise ValueError(f"head_dim={head_dim!r} in {config_source(config)} is not supported: Ergo's heads are "
                         f"hidden_size / num_attention_heads = {heads_width} wide")
    scale = config.global_attention_scale
    if scale is not None and not scale >= 0:  # its square root scales the queries and keys
        raise ValueError(f"global_attention_scale={scale!r} in {config_source(config)} is not supported; expected "
                         f">= 0 or None")


# The Hub's tensors that it stores [in, out], and transformers' names for them: transposed on load.
HUB_TRANSPOSED = {".feed_forward.gate_kernel": ".mlp.gate.linear.weight",
                  ".feed_forward.shared_up_proj": ".mlp.shared_experts.up_proj.weight",
                  ".feed_forward.shared_down_proj": ".mlp.shared_experts.down_proj.weight"}


class ErgoForCausalLM(LlamaForCausalLM):
    model_class = ErgoModel
    lm_head_fp32_logits = True
    packed_modules_mapping = {}  # q/k/v come fused (qkv_proj), the MLPs have no gate
    # The Hub's names (transformers' conversion mapping, which its save_pretrained writes back) to transformers' own,
    # then those to the engine's: DenseMLP's fc1 / fc2, the router's weight as DeepseekRouter holds it.
    weight_name_substitutions = {
        "^tok_embeddings.": "model.embed_tokens.", "^norm.": "model.norm.", "^output.": "lm_head.",
        "^layers.": "model.layers.", ".attention_norm.": ".input_layernorm.",
        ".post_attention_norm.": ".post_attention_layernorm.", ".ffn_norm.": ".pre_feedforward_layernorm.",
        ".post_ffn_norm.": ".post_feedforward_layernorm.",
        ".post_attention_residual.scale": ".attention_residual_gate.weight",
        ".post_ffn_residual.scale": ".feedforward_residual_gate.weight",
        ".attention.wqkv.": ".self_attn.qkv_proj.", ".attention.wo.": ".self_attn.o_proj.",
        ".attention.": ".self_attn.", ".feed_forward.up.": ".mlp.up_proj.", ".feed_forward.down.": ".mlp.down_proj.",
        ".feed_forward.router_bias": ".mlp.gate.e_score_correction_bias",
        ".feed_forward.up_proj": ".mlp.experts.up_proj", ".feed_forward.down_proj": ".mlp.experts.down_proj",
        ".feed_forward.expert_output_norm.scale": ".mlp.experts.post_expert_norm.weight",
        ".feed_forward.shared_expert_output_norm.scale": ".mlp.shared_experts.norm.weight",
        ".mlp.up_proj.": ".mlp.fc1.", ".mlp.down_proj.": ".mlp.fc2.",
        ".shared_experts.up_proj.": ".shared_experts.fc1.", ".shared_experts.down_proj.": ".shared_experts.fc2.",
        ".mlp.gate.linear.": ".mlp.gate."}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        layer_type, scale = config.layer_types[layer_idx], config.global_attention_scale
        window = config.sliding_window if layer_type == "sliding_attention" else None
        return AttentionOptions(qk_norm=True, qk_norm_class=GptOssRMSNorm,
                                head_dim=config.hidden_size // config.num_attention_heads, sliding_window=window,
                                rope=config.rope_parameters.get(layer_type) is not None, rope_layer_type=layer_type,
                                rope_interleaved=True, rope_fp64=True,
                                qk_scale=scale ** 0.5 if window is None and scale is not None else None)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if mlp_layer_type(config, layer_idx) == "sparse":
            return ErgoMoE(config)
        return DenseMLP(config, False, config.first_dense_intermediate_size, "relu2")

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        config.tie_word_embeddings = False  # transformers' Ergo has no such setting: never tied
        super().__init__(config)

    @staticmethod
    def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, the Hub's [in, out] ones (HUB_TRANSPOSED) transposed under transformers' names."""
        for name, tensor in weights:
            hub = next((suffix for suffix in HUB_TRANSPOSED if name.endswith(suffix)), None)
            if hub is None:
                yield name, tensor
            else:
                yield name.removesuffix(hub) + HUB_TRANSPOSED[hub], tensor[...].t()
