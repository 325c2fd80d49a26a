"""OLMo Hybrid (`OlmoHybridForCausalLM`): OLMo 3's post-norm attention layers (RMSNorms over the whole q and k
projections, rope where the config has a rope_theta, no window) between pre-norm Gated DeltaNet layers, as
`layer_types` says: Qwen3.5's linear attention (qwen3_5.py) with q, k, v (and their convs) stored apart, its own
output gate projection, the gated norm's epsilon FLA's 1e-5, and beta doubled where `linear_allow_neg_eigval`; all
norms OLMo's (the weight applied in fp32)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import GatedRMSNorm, OlmoRMSNorm, RMSNorm
from nanoinfer.layers.recurrent import RecurrentBatch
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM, check_layer_config
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP
from nanoinfer.models.olmo2 import Olmo2DecoderLayer
from nanoinfer.models.qwen3_5 import Qwen3_5GatedDeltaNet

# transformers' OLMo Hybrid gated norm: FLA's default epsilon, whatever rms_norm_eps says.
GATED_NORM_EPS = 1e-5


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    where = check_layer_config(config)
    if config.linear_num_value_heads != config.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads={config.linear_num_value_heads} != linear_num_key_heads="
                         f"{config.linear_num_key_heads} in {where} is not supported: transformers' OLMo Hybrid "
                         "pairs each value head with one key head")


class OlmoHybridGatedDeltaNet(Qwen3_5GatedDeltaNet):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.norm = GatedRMSNorm(self.head_v_dim, GATED_NORM_EPS)
        self.max_beta = 2.0 if config.linear_allow_neg_eigval else 1.0


class OlmoHybridAttentionLayer(Olmo2DecoderLayer):
    """OLMo 3's layer, called as the hybrid's layers are (it needs no recurrent batch)."""

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, batch: RecurrentBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(positions, x, residual, meta)


class OlmoHybridForCausalLM(HybridForCausalLM):
    # The linear attention's q, k, v and their convs stored apart: segments of Qwen3.5's fused rows. First, before
    # the attention layers' q/k/v.
    packed_modules_mapping = {
        "mixer.q_proj": ("mixer.in_proj_qkv", 0), "mixer.k_proj": ("mixer.in_proj_qkv", 1),
        "mixer.v_proj": ("mixer.in_proj_qkv", 2), "mixer.q_conv1d": ("mixer.conv1d", 0),
        "mixer.k_conv1d": ("mixer.conv1d", 1), "mixer.v_conv1d": ("mixer.conv1d", 2),
        **LlamaForCausalLM.packed_modules_mapping}
    # The Hub's names (which transformers' save_pretrained writes back) and transformers' to Qwen3.5's layer's.
    weight_name_substitutions = {
        ".linear_attn.": ".mixer.", ".mixer.g_proj.": ".mixer.in_proj_z.", ".mixer.a_proj.": ".mixer.in_proj_a.",
        ".mixer.b_proj.": ".mixer.in_proj_b.", ".mixer.o_proj.": ".mixer.out_proj.", ".mixer.o_norm.": ".mixer.norm.",
        ".attention_layer_norm.": ".input_layernorm.", ".feedforward_layer_norm.": ".post_attention_layernorm."}

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if config.layer_types[layer_idx] == "linear_attention":
            return HybridDecoderLayer(config, OlmoHybridGatedDeltaNet(config), False, LlamaMLP(config),
                                      config.rms_norm_eps, norm=OlmoRMSNorm)
        bias = config.attention_bias
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") is not None
        return OlmoHybridAttentionLayer(config, AttentionOptions(qkv_bias=bias, o_bias=bias, rope=rope),
                                        LlamaMLP(config))

    def make_final_norm(self, config: PretrainedConfig, eps: float) -> RMSNorm:
        return OlmoRMSNorm(config.hidden_size, eps)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config, config.rms_norm_eps)
