"""Gemma 4 (text): Gemma 3's layer (gemma3.py: sandwich norms, sliding and full layers with their own ropes, q/k
norms, scaled embeddings, final-logit softcapping) with plain-weight RMSNorms (w, not 1 + w) everywhere, unscaled
attention scores (the q/k norms set their size), values normalized per head without a weight, wider heads (and,
optionally, fewer KV heads) on full layers, whose rope ("proportional") turns only the leading frequencies of the
whole head, values taken from the key projection on full layers with `attention_k_eq_v`, and a learned scalar
multiplying each layer's output. Its MoE variant runs, in every layer, the dense MLP and top-k routed experts side
by side, each with its own norms, the router reading the residual stream."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.fused_moe import FusedMoE, select_experts
from nanoinfer.layers.layernorm import OlmoRMSNorm, rms_normalize
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models import gemma, gemma2
from nanoinfer.models.llama import AttentionOptions, LlamaMLP, layer_sliding_window


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    gemma2.check_layer_types(config)
    # "vision": image tokens attend both ways among themselves; text alone is causal.
    if config.use_bidirectional_attention == "all":
        raise ValueError("use_bidirectional_attention='all' in the model config: only causal Gemma 4 is supported")
    if config.hidden_size_per_layer_input:
        raise ValueError(f"hidden_size_per_layer_input={config.hidden_size_per_layer_input} in the model config: "
                         "Gemma 4's per-layer embeddings (E2B/E4B) are not supported")
    if config.num_kv_shared_layers:
        raise ValueError(f"num_kv_shared_layers={config.num_kv_shared_layers} in the model config: layers reusing "
                         "another layer's keys and values (Gemma 4 E2B/E4B) are not supported")
    if config.enable_moe_block and config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={config.hidden_activation!r} in the model config: Gemma 4's experts are "
                         "implemented with 'gelu_pytorch_tanh' only")


def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    """The layer's head size and KV heads (transformers' per-layer config: wider on full layers), scores unscaled,
    (w) q/k norms, a weightless value norm. The rope spans the whole head: "proportional" rope's frequencies past
    its partial_rotary_factor are zero (those pairs, i and i + head_dim / 2, do not turn), which is not a rotation
    of the leading dims alone."""
    layer = config.per_layer_config[layer_idx]
    layer_type = config.layer_types[layer_idx]
    bias = config.attention_bias
    return AttentionOptions(qkv_bias=bias, o_bias=bias, scale=1.0, qk_norm=True, qk_norm_class=OlmoRMSNorm,
                            value_norm=True, key_as_value=config.attention_k_eq_v and layer_type == "full_attention",
                            head_dim=layer.head_dim, num_kv_heads=layer.num_key_value_heads,
                            rotary_dim=layer.head_dim, rope_layer_type=layer_type,
                            sliding_window=layer_sliding_window(config, layer_idx))


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


class Gemma4Router(nn.Module):
    """Top-k of a softmax over the experts, rescaled to sum to 1 and then by a learned scale per expert; its input
    is normalized without a weight, then scaled by a learned vector and hidden_size ** -0.5."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.proj = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.scale = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts), requires_grad=False)
        self.eps, self.top_k, self.root_size = config.rms_norm_eps, config.top_k_experts, config.hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> the top k experts' weights and ids, [tokens, k] each."""
        logits = self.proj(rms_normalize(x, self.eps) * self.scale * self.root_size)
        weights, ids = select_experts(logits, self.top_k, renormalize=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(gemma2.Gemma2DecoderLayer):
    """Gemma 2's sandwich norms; with `enable_moe_block`, the experts' output (from the residual stream, under their
    own pre-norm) joins the dense MLP's, each after a norm of its own; the layer's whole output (residual stream
    included) is scaled by `layer_scalar`, so each layer hands the next its sum rather than a pending residual add."""

    norm_class = OlmoRMSNorm

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.router: Gemma4Router | None = None
        if config.enable_moe_block:
            self.router = Gemma4Router(config)
            self.experts = FusedMoE(config.num_experts, config.top_k_experts, config.hidden_size,
                                    config.moe_intermediate_size, renormalize=True, activation=gelu_tanh_and_mul)
            norm = self.norm_class
            self.pre_feedforward_layernorm_2 = norm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm_1 = norm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm_2 = norm(config.hidden_size, config.rms_norm_eps)

    def feed_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The MLP of the normed x, plus, with experts, theirs of the residual stream."""
        x = self.mlp(x)
        if self.router is None:
            return x
        routed = self.experts.run_experts(self.pre_feedforward_layernorm_2(residual), *self.router(residual))
        return self.post_feedforward_layernorm_1(x) + self.post_feedforward_layernorm_2(routed)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, None]:
        x, residual = self.attention(positions, x, residual, meta)
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        x = residual + self.post_feedforward_layernorm(self.feed_forward(x, residual))
        return x * self.layer_scalar, None


class Gemma4Model(gemma.GemmaModel):
    decoder_layer = Gemma4DecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        x = self.embed(input_ids, positions)
        for layer in self.layers:
            x, _ = layer(positions, x, None, meta)
        return self.norm(x)


class Gemma4ForCausalLM(gemma2.Gemma2ForCausalLM):
    model_class = Gemma4Model
    # transformers' Gemma4ForConditionalGeneration softcaps its logits as the text model does (Gemma 3's wrapper
    # does not): the vision-language reading keeps compute_logits (see vision_language.py).
    wrapper_scales_logits = True
    check_config = staticmethod(check_config)
    attention_options = staticmethod(attention_options)
