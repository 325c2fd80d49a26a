"""Kimi Linear (`KimiLinearForCausalLM`): Kimi Delta Attention (KDA) layers between multi-head latent attention layers,
as `layer_types` says. KDA is Gated DeltaNet's token mixing (layers/gated_delta_rule.py) with a decay per key channel
(from a low-rank forget gate) instead of per head, a head of values per head of keys, q, k, v (and their convs)
stored apart, and a sigmoid-gated norm (the gate from a low-rank projection). The MLA layers are DeepSeek's
(deepseek_v2.py) without rope: the shared key part stays unrotated. Each MLP is dense or DeepSeek-V3's MoE (sigmoid
routing with the correction bias within the best groups, shared experts) as `mlp_layer_types` says. Under tensor
parallelism KDA shards by heads (their projection rows, conv channels, gates and state; o_proj's columns), MLA and the
MoE as DeepSeek's. Prefix caching is off, as for the other hybrids (a cached prefix has K/V but no recurrent state)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.gated_delta_rule import GatedDeltaRule
from nanoinfer.layers.layernorm import GatedRMSNorm
from nanoinfer.layers.linear import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                     SegmentedColumnParallelLinear)
from nanoinfer.layers.recurrent import RecurrentBatch, RowShardedWeight, load_rank_rows
from nanoinfer.models.deepseek_v2 import DeepseekV2Attention, DeepseekV2ForCausalLM
from nanoinfer.models.deepseek_v3 import mlp_by_layer_type
from nanoinfer.models.hybrid import (HybridDecoderLayer, HybridForCausalLM, check_layer_config,
                                    mixers_named_self_attn)
from nanoinfer.models.llama import AttentionOptions
from nanoinfer.utils.dist import tp_size


class KimiDeltaAttention(nn.Module):
    """KDA: g = -e^A_log[h] * softplus(f_b(f_a(x)) + dt_bias) per key channel, beta = sigmoid(b_proj(x)), the delta
    rule over the convolved, l2-normed q and k, then RMSNorm(out) * sigmoid(g_b(g_a(x))) per head and o_proj.
    num_heads is this rank's. Ling's (bailing_hybrid.py) differs in its gates alone: init_gates, forget_input,
    output_gate and decay."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        heads, head_dim, hidden = config.linear_num_heads, config.linear_head_dim, config.hidden_size
        self.num_heads, self.head_dim = heads // tp_size(), head_dim
        width, kernel = heads * head_dim, config.linear_conv_kernel_dim
        self.in_proj_qkv = SegmentedColumnParallelLinear(hidden, [(width, True)] * 3)  # q_proj | k_proj | v_proj
        self.conv1d = RowShardedWeight([(width, True)] * 3, (1, kernel), bias=False)  # q_conv1d | k_conv1d | v_conv1d
        self.init_gates(hidden, head_dim, width)
        # fp32 in every model dtype, as transformers 5.25 keeps it (`_keep_in_fp32_modules_strict`; 5.23 rounded it).
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads * head_dim, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.b_proj = ColumnParallelLinear(hidden, heads)
        self.o_norm = GatedRMSNorm(head_dim, config.rms_norm_eps, torch.sigmoid, weight_in_fp32=True)
        self.o_proj = RowParallelLinear(width, hidden)
        self.delta_rule = GatedDeltaRule(self.num_heads, self.num_heads, head_dim, head_dim, kernel)

    def init_gates(self, hidden: int, head_dim: int, width: int) -> None:
        """The projections of the forget gate's and the output gate's inputs: low-rank, through head_dim."""
        self.f_a_proj = ReplicatedLinear(hidden, head_dim)
        self.f_b_proj = ColumnParallelLinear(head_dim, width)
        self.g_a_proj = ReplicatedLinear(hidden, head_dim)
        self.g_b_proj = ColumnParallelLinear(head_dim, width)

    def forget_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.f_b_proj(self.f_a_proj(x))

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_b_proj(self.g_a_proj(x))

    @staticmethod
    def softplus(f: torch.Tensor) -> torch.Tensor:
        # transformers' KimiLinearForgetGate takes log(1 + e^f), not F.softplus's log1p (which parts from it by up to
        # fp32's spacing at 1).
        return torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """The log-decay per key channel of f = forget_input + dt_bias [tokens, heads, head_dim] (fp32)."""
        return -self.A_log.float().exp().unsqueeze(-1) * self.softplus(f)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A_log (stored [1, 1, heads, 1]) and dt_bias: this rank's heads."""
        load_rank_rows(param, loaded[...].reshape(-1))

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        heads = (x.shape[0], self.num_heads, self.head_dim)
        g = self.decay((self.forget_input(x).float() + self.dt_bias.float()).view(heads))
        beta = self.b_proj(x).sigmoid()  # in the model's dtype, as transformers' KDA takes it
        out = self.delta_rule(self.in_proj_qkv(x), self.conv1d.weight.squeeze(1), g, beta, batch).to(x.dtype)
        return self.o_proj(self.o_norm(out, self.output_gate(x).view(heads)).flatten(1))


class KimiLinearForCausalLM(HybridForCausalLM):
    # KDA's q, k, v and their convs: segments of the fused rows. First, before the MLPs' gate/up (MLA's q_proj is a
    # projection of its own).
    packed_modules_mapping = {
        "mixer.q_proj": ("mixer.in_proj_qkv", 0), "mixer.k_proj": ("mixer.in_proj_qkv", 1),
        "mixer.v_proj": ("mixer.in_proj_qkv", 2), "mixer.q_conv1d": ("mixer.conv1d", 0),
        "mixer.k_conv1d": ("mixer.conv1d", 1), "mixer.v_conv1d": ("mixer.conv1d", 2),
        **DeepseekV2ForCausalLM.packed_modules_mapping}

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        mlp = mlp_by_layer_type(config, layer_idx)
        if config.layer_types[layer_idx] == "linear_attention":
            return HybridDecoderLayer(config, KimiDeltaAttention(config), False, mlp, config.rms_norm_eps)
        return HybridDecoderLayer(config, DeepseekV2Attention(config, AttentionOptions(rope=False)), True, mlp,
                                  config.rms_norm_eps)

    def __init__(self, config: PretrainedConfig):
        check_layer_config(config, "linear_num_heads", silu=True)
        # DeepSeek-V3's MoE reads its expert count under DeepSeek's name (the shared experts' is an alias already).
        config.n_routed_experts = config.num_experts
        super().__init__(config, config.rms_norm_eps)
        # Checkpoints name both mixers `self_attn`, the MLPs `block_sparse_moe`, the experts' gate/up/down
        # `w1`/`w3`/`w2` (see fused_moe.expert_weight_target).
        self.weight_name_substitutions = {".block_sparse_moe.": ".mlp.", **mixers_named_self_attn(config)}
