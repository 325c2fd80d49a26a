"""LongCat-Flash (`LongcatFlashForCausalLM`, Meituan's): `num_layers` decoder layers of two pre-norm sublayer pairs
each, MLA attention (DeepSeek-V3's, deepseek_v2.py: low-rank q, interleaved rope) with the queries scaled by
sqrt(hidden / q_lora_rank) and the normalized KV latent by sqrt(hidden / kv_lora_rank), then a dense MLP; the first
pair's normed attention output also feeds a "shortcut" MoE whose output joins the layer's at its end. The MoE routes
by softmax over the real experts and `zero_expert_num` zero-computation ones (the top k of probability + a correction
bias, not renormalized, times `routed_scaling_factor`); a zero expert returns its input, weighted."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.fused_moe import FusedMoE, Fp32Router
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.deepseek_v2 import DeepseekV2Attention, check_moe_config
from nanoinfer.models.ernie4_5_moe import select_experts_softmax_biased
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP, LlamaModel


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    where = config_source(config)
    if config.head_dim != config.qk_rope_head_dim:  # transformers' rope tables are head_dim wide
        raise ValueError(f"head_dim={config.head_dim} in {where} is not supported: the rope rotates "
                         f"qk_rope_head_dim={config.qk_rope_head_dim} dimensions")
    if getattr(config, "router_bias", False):  # transformers' router holds a bias it never adds
        raise ValueError(f"router_bias={config.router_bias} in {where} is not supported")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} in {where} is not supported; only 'silu' is implemented")


class LongcatFlashMLA(DeepseekV2Attention):
    """MLA with LongCat's LoRA scales: the query (both its parts) and the normalized latent, cached scaled."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(config, options)
        self.q_scale = (config.hidden_size / config.q_lora_rank) ** 0.5
        self.latent_scale = (config.hidden_size / config.kv_lora_rank) ** 0.5

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return super().query(x) * self.q_scale

    def normalize_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return super().normalize_latent(latent) * self.latent_scale


def zero_expert_suffixes(config: PretrainedConfig) -> tuple[str, ...]:
    """transformers' LongcatFlashExperts holds gate/up projections for the zero experts too, never used, and
    save_pretrained writes them (per expert, after the real ones): not loaded here."""
    zero_experts = range(config.n_routed_experts, config.n_routed_experts + config.zero_expert_num)
    return tuple(f".mlp.experts.{e}.{proj}.weight" for e in zero_experts for proj in ("gate_proj", "up_proj"))


class ZeroExpertFusedMoE(FusedMoE):
    """The real experts, which skip the slots routed to zero experts; from transformers' stacked layout, the gate/up
    stack's first n_routed_experts (see zero_expert_suffixes)."""
    skips_zero_experts = True

    def __init__(self, config: PretrainedConfig):
        super().__init__(config.n_routed_experts, config.moe_topk, config.hidden_size, config.expert_ffn_hidden_size,
                         renormalize=False)  # routed by LongcatFlashMoE
        self.num_total_experts = config.n_routed_experts + config.zero_expert_num

    def load_stacked(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is self.w13_weight and loaded.shape[0] == self.num_total_experts:
            loaded = loaded[...][:self.num_experts]
        super().load_stacked(param, loaded)


class LongcatFlashRouter(Fp32Router):
    """fp32 logits of the weight in the model's dtype, and the correction bias in the model's dtype, as transformers
    5.23 holds them (its `_keep_in_fp32_modules` names `classifier.weight`, which matches no module)."""

    def __init__(self, config: PretrainedConfig):
        num_experts = config.n_routed_experts + config.zero_expert_num
        super().__init__(config.hidden_size, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)


class LongcatFlashMoE(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_moe_config(config, grouped=False, width_field="expert_ffn_hidden_size")  # no alias before 5.23
        self.top_k, self.scaling = config.moe_topk, config.routed_scaling_factor
        self.gate = LongcatFlashRouter(config)
        self.experts = ZeroExpertFusedMoE(config)

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 weights and ids [tokens, top k], zero experts (ids from n_routed_experts on) among them."""
        return select_experts_softmax_biased(self.gate(x), self.top_k, self.gate.e_score_correction_bias, None,
                                             self.scaling, sorted_topk=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.select_experts(x)
        y = self.experts.run_experts(x, weights, ids)  # the real experts' share
        identity = weights.masked_fill(ids < self.experts.num_experts, 0.0).sum(-1, keepdim=True)  # a zero expert's
        return y + (x * identity).to(x.dtype)


class LongcatFlashDecoderLayer(nn.Module):
    """Two (attention, dense MLP) pairs; the MoE reads the first pair's normed attention output, and its output is
    added with the second MLP's."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, moe: nn.Module):
        super().__init__()
        self.mlp = moe
        self.self_attn = nn.ModuleList(LongcatFlashMLA(config, options) for _ in range(2))
        self.mlps = nn.ModuleList(LlamaMLP(config) for _ in range(2))
        self.input_layernorm, self.post_attention_layernorm = (
            nn.ModuleList(RMSNorm(config.hidden_size, config.rms_norm_eps) for _ in range(2)) for _ in range(2))

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        shortcut = None
        for i in range(2):
            if residual is None:
                x, residual = self.input_layernorm[i](x), x
            else:
                x, residual = self.input_layernorm[i](x, residual)
            x, residual = self.post_attention_layernorm[i](self.self_attn[i](positions, x, meta), residual)
            shortcut = self.mlp(x) if shortcut is None else shortcut
            x = self.mlps[i](x)
        return x + shortcut, residual


class LongcatFlashModel(LlamaModel):
    decoder_layer = LongcatFlashDecoderLayer

    @staticmethod
    def num_layers(config: PretrainedConfig) -> int:
        return config.num_layers  # num_hidden_layers counts the attention sublayers


class LongcatFlashForCausalLM(LlamaForCausalLM):
    model_class = LongcatFlashModel
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    weight_name_substitutions = {".mlp.router.classifier.": ".mlp.gate.", ".mlp.router.": ".mlp.gate."}
    ignored_weight_prefixes = ("model.mtp.",)  # the multi-token-prediction layers: not used here

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(rope_interleaved=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LongcatFlashMoE(config)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
        self.ignored_weight_suffixes = zero_expert_suffixes(config)
