"""NemotronH (`NemotronHForCausalLM`: Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): each layer is one pre-norm
block, by `layers_block_type` (the Hub's `hybrid_override_pattern`): Mamba2 ("M"), attention without position encoding
("*"), a relu^2 MLP ("-") or relu^2 experts with sigmoid routing and a shared expert ("E")."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.fused_moe import FusedMoE, relu2, select_experts_sigmoid_biased
from nanoinfer.layers.layernorm import OlmoRMSNorm, RMSNorm
from nanoinfer.layers.mamba2 import Mamba2Mixer, Mamba2Settings
from nanoinfer.layers.recurrent import RecurrentBatch
from nanoinfer.models.deepseek_v2 import DeepseekRouter, check_moe_config
from nanoinfer.models.hybrid import HybridForCausalLM
from nanoinfer.models.layernorm_decoder import DenseMLP
from nanoinfer.models.llama import AttentionOptions, LlamaAttention


def mamba2_settings(config: PretrainedConfig) -> Mamba2Settings:
    """NemotronH's names; dt clamped to `time_step_limit`, as NVIDIA's code and transformers 5.25 clamp it (5.23 clamps
    it from below at `time_step_min` instead)."""
    return Mamba2Settings(config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                          config.ssm_state_size, config.conv_kernel, config.chunk_size, config.layer_norm_epsilon,
                          config.use_conv_bias, config.use_bias, config.use_bias,
                          tuple(config.time_step_limit), config.mamba_hidden_act)


class NemotronHMoE(nn.Module):
    """Routed experts without a gate (relu^2), chosen as DeepSeek-V3's are (sigmoid scores plus a correction bias,
    within the best groups), weighted and summed in fp32 (as transformers' NemotronHExperts), plus one shared relu^2
    MLP."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.moe_latent_size is not None:
            raise ValueError(f"moe_latent_size={config.moe_latent_size} (latent expert projections) is not "
                             f"supported")
        check_moe_config(config, grouped=True)
        self.top_k, self.scaling = config.num_experts_per_tok, config.routed_scaling_factor
        self.num_groups, self.topk_group, self.renormalize = config.n_group, config.topk_group, config.norm_topk_prob
        self.gate = DeepseekRouter(config, correction_bias=True, fp32_weight=True)  # as DeepseekV2MoE's
        self.experts = FusedMoE(config.n_routed_experts, self.top_k, config.hidden_size,
                                config.moe_intermediate_size, renormalize=False, activation=relu2, gated=False)
        self.shared_experts = DenseMLP(config, config.mlp_bias, config.moe_shared_expert_intermediate_size,
                                       config.mlp_hidden_act)

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts_sigmoid_biased(self.gate(x), self.top_k, self.gate.e_score_correction_bias,
                                             self.num_groups, self.topk_group, self.renormalize, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *self.select_experts(x)) + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """x + mixer(norm(x)), the mixer by the layer's block type; the norms apply their weight in fp32 and round once
    (transformers' NemotronHRMSNorm, as OLMo 2's)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.block_type = config.layers_block_type[layer_idx]
        if self.block_type == "linear_attention":
            self.mixer = Mamba2Mixer(mamba2_settings(config))
        elif self.block_type == "full_attention":  # transformers' has no biases, whatever attention_bias says
            self.mixer = LlamaAttention(config, AttentionOptions(rope=False))
        elif self.block_type == "mlp":
            self.mixer = DenseMLP(config, config.mlp_bias, hidden_act=config.mlp_hidden_act)
        elif self.block_type == "moe":
            self.mixer = NemotronHMoE(config)
        else:
            raise ValueError(f"unsupported block type {self.block_type!r} in layer {layer_idx}")
        self.norm = OlmoRMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, batch: RecurrentBatch) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (self.norm(x), x) if residual is None else self.norm(x, residual)
        if self.block_type == "full_attention":
            return self.mixer(positions, x, meta), residual
        if self.block_type == "linear_attention":
            return self.mixer(x, batch), residual
        return self.mixer(x), residual


class NemotronHForCausalLM(HybridForCausalLM):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    # The Hub's names (`backbone.`) and transformers' (`model.`); the relu^2 MLPs' up / down are DenseMLP's fc1 / fc2.
    weight_name_substitutions = {
        "^backbone.": "model.",
        "model.embeddings.": "model.embed_tokens.",
        "model.norm_f.": "model.norm.",
        ".mixer.up_proj.": ".mixer.fc1.",
        ".mixer.down_proj.": ".mixer.fc2.",
        ".shared_experts.up_proj.": ".shared_experts.fc1.",
        ".shared_experts.down_proj.": ".shared_experts.fc2.",
    }

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return NemotronHBlock(config, layer_idx)

    def make_final_norm(self, config: PretrainedConfig, eps: float) -> RMSNorm:
        return OlmoRMSNorm(config.hidden_size, eps)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, config.layer_norm_epsilon)
        # The multi-token-prediction layers (Nemotron 3), which transformers does not load either.
        self.ignored_weight_prefixes = ("mtp.", "model.mtp.", "backbone.mtp.")
