"""Ling/Ring hybrids (`BailingHybridForCausalLM`, inclusionAI's Ling 3.0): Kimi Delta Attention layers (kimi_linear.py)
between multi-head latent attention layers, as `layer_types` says (by default every `layer_group_size`-th layer MLA).
Its KDA differs from Kimi's in its gates alone: full-rank projections of the forget gate's and the output gate's
inputs, and with `kda_safe_gate` a bounded log-decay, lower_bound * sigmoid(e^A_log * (f + dt_bias)), in place of
-e^A_log * softplus(f + dt_bias). Its MLA is DeepSeek-V3's (deepseek_v2.py: interleaved rope) with q projected at
full rank and each head's output times sigmoid(g_proj(x)) before o_proj. Each MLP is dense or DeepSeek-V3's MoE as
`mlp_layer_types` says. Tensor parallelism and prefix caching (off: a cached prefix has K/V but no recurrent state)
as Kimi Linear's."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.linear import ColumnParallelLinear
from nanoinfer.models.deepseek_v2 import DeepseekV2Attention
from nanoinfer.models.deepseek_v3 import mlp_by_layer_type, mtp_layer_prefixes
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM, check_layer_config, mixers_named_self_attn
from nanoinfer.models.kimi_linear import KimiDeltaAttention, KimiLinearForCausalLM
from nanoinfer.models.llama import AttentionOptions


class BailingHybridDeltaAttention(KimiDeltaAttention):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.lower_bound = config.kda_lower_bound if config.kda_safe_gate else None  # None: Kimi's decay
        self.model_dtype = torch.get_default_dtype()  # the one the engine builds the model under
        self.keep_in_fp32()

    def keep_in_fp32(self) -> None:
        """The conv's weight, dt_bias and A_log in fp32 in every model dtype, as transformers keeps them
        (`_keep_in_fp32_modules_strict`): in bf16, dt_bias's rounding (up to 0.016 near -5) times the head rate
        e^A_log (transformers initialises it in [1, 16]) would move the bounded decay by several percent."""
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):
            param.data = param.data.float()

    def init_gates(self, hidden: int, head_dim: int, width: int) -> None:
        self.f_proj = ColumnParallelLinear(hidden, width)
        self.g_proj = ColumnParallelLinear(hidden, width)

    def forget_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.f_proj(x)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x)

    softplus = staticmethod(F.softplus)  # transformers' BailingHybridForgetGate's, unlike Kimi's

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """Rounded to the model's dtype, as transformers' forget gate returns it (the delta rule then takes it in
        fp32)."""
        g = (super().decay(f) if self.lower_bound is None
             else self.lower_bound * torch.sigmoid(self.A_log.float().exp().unsqueeze(-1) * f))
        return g.to(self.model_dtype)


class BailingHybridForCausalLM(HybridForCausalLM):
    packed_modules_mapping = KimiLinearForCausalLM.packed_modules_mapping

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        mlp = mlp_by_layer_type(config, layer_idx)
        if config.layer_types[layer_idx] == "linear_attention":
            return HybridDecoderLayer(config, BailingHybridDeltaAttention(config), False, mlp, config.rms_norm_eps)
        options = AttentionOptions(rope_interleaved=True, gate_activation=torch.sigmoid, gate_per_head=True)
        return HybridDecoderLayer(config, DeepseekV2Attention(config, options), True, mlp, config.rms_norm_eps)

    def __init__(self, config: PretrainedConfig):
        where = check_layer_config(config, "linear_num_heads", silu=True)
        if config.tie_word_embeddings:  # transformers' model never ties them (its _tied_weights_keys is empty)
            raise ValueError(f"tie_word_embeddings=True in {where} is not supported: transformers' "
                             f"BailingHybridForCausalLM keeps lm_head apart from the embedding")
        # DeepSeek-V3's MoE reads its expert count under DeepSeek's name (the config aliases the others).
        config.n_routed_experts = config.num_experts
        super().__init__(config, config.rms_norm_eps)
        self.ignored_weight_prefixes = mtp_layer_prefixes(config)
        # The checkpoints' names (which transformers' save_pretrained writes too): `attention` for both mixers
        # (`dense` for o_proj), `word_embeddings`, the router's `expert_bias`; KDA's q/k/v convs stored apart.
        self.weight_name_substitutions = {
            **mixers_named_self_attn(config, "attention"), ".attention.": ".self_attn.", ".dense.": ".o_proj.",
            "^model.word_embeddings.": "model.embed_tokens.",
            ".mlp.gate.expert_bias": ".mlp.gate.e_score_correction_bias"}
