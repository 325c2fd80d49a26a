"""Llama decoder; Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3 and Llama 4 reuse it with their per-layer attention options
(qkv bias, per-head q/k norm, sliding window, sinks, query temperature) and, for MoE, their own MLP per layer; Gemma 3
its layers' parts."""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import get_act_and_mul
from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import RMSNorm, ShardedRMSNorm, rms_normalize
from nanoinfer.layers.linear import (ColumnParallelLinear, KeyAsValueQKVParallelLinear, MergedColumnParallelLinear,
                                     QKVParallelLinear, RowParallelLinear)
from nanoinfer.layers.recurrent import load_rank_rows
from nanoinfer.layers.rotary_embedding import get_rope


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_after_rope: bool = False  # HunYuan: the q/k norms take the rotated q and k
    sliding_window: int | None = None  # attend to the last this-many positions (the query's own included)
    attention_chunk_size: int | None = None  # Llama 4's chunked local attention: keys of the query's own chunk alone
    # Qwen3-Next: q_proj also yields a per-head output gate (attention output * sigmoid(gate) before o_proj).
    output_gate: bool = False
    # AFMoE, Laguna, Beam, Ling's MLA: a projection of its own (g_proj) gates the attention output before o_proj,
    # through this activation (taken in fp32), one gate per element or (gate_per_head) one per head; with gate_bias
    # (Beam's), a learned bias per head added to its gates first.
    gate_activation: Callable[[torch.Tensor], torch.Tensor] | None = None
    gate_per_head: bool = False
    gate_bias: bool = False
    num_heads: int | None = None  # Laguna: this layer's query heads, where they differ by layer
    # The q/k norms' class where not RMSNorm: Gemma 3's and Qwen3-Next's GemmaRMSNorm (1 + weight, in fp32), Gemma 4's
    # OlmoRMSNorm (its rounding), Llama 4's WeightlessRMSNorm (x / rms(x) alone, no checkpoint weight). Gemma 3 also:
    # its own score scale (default head_dim ** -0.5), and the rope settings of the layer's type (its config nests them
    # by "sliding_attention" / "full_attention").
    qk_norm_class: type[RMSNorm] | None = None
    scale: float | None = None
    rope_layer_type: str | None = None
    rope: bool = True  # SmolLM3's NoPE layers: no position encoding at all
    rope_theta: float | None = None  # GraniteSWA: this layer's rope base, in place of the config's
    rope_interleaved: bool = False  # Cohere, GLM: rope rotates the pairs (x0, x1), (x2, x3), ...
    rope_reversed: bool = False  # NanoChat: rope turns by minus the angle (see get_rope)
    rope_fp64: bool = False  # Ergo: the rope table's angles in fp64 (exact at long-context positions)
    # transformers' Llama (and the families that copy its rope): in 16-bit models cos, sin, each product and each sum
    # rounded to the activations' dtype, not one fp32 rotation rounded once (see RotaryEmbedding)
    rope_in_dtype: bool = False
    rope_scaled: bool = True  # Molmo 2's layers outside rope_scaling_layers: False, the rope's base alone (unscaled)
    logits_soft_cap: float | None = None  # Gemma 2: scores capped to cap * tanh(score / cap)
    clip_qkv: float | None = None  # OLMo: q, k, v clamped to [-clip_qkv, clip_qkv] first (OLMoE: after q/k norms)
    num_kv_heads: int | None = None  # where the config's `num_key_value_heads` does not say (Falcon, GPTBigCode)
    rotary_dim: int | None = None  # GPT-J: the leading dims rotated, where the config's rope settings do not say
    sinks: bool = False  # GPT-OSS: a learned logit per head joins each softmax's denominator
    # BLOOM, MPT: ALiBi, the model's slope per head (layers/attention/alibi.py); such layers take rope=False
    alibi_slopes: torch.Tensor | None = None
    # Llama 4's NoPE layers (attention temperature tuning, see llama4_query_scale), Ministral 3, Mistral 4's MLA and
    # Beam's NoPE layers: positions -> an fp32 factor per token that scales its query after rope.
    query_scale: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Ergo's full layers: queries and keys times this factor (rounded to their dtype first) after rope.
    qk_scale: float | None = None
    # ModernBERT's local layers: the window holds in the (non-causal) encoder pass, on both sides (see Attention)
    encoder_only: bool = False
    # Gemma 4: the layer's own head size (its full layers' heads are wider than the config's `head_dim`), values
    # scaled to unit RMS per head (a weightless norm), and, with `key_as_value`, values from the key projection.
    head_dim: int | None = None
    value_norm: bool = False
    key_as_value: bool = False
    # MiMo-V2-Flash: value heads narrower than the query and key heads (the cache holds them zero-padded to head_dim,
    # and each head's output keeps its first v_head_dim entries), the values times value_scale.
    v_head_dim: int | None = None
    value_scale: float | None = None
    output_norm: bool = False  # BitNet: an RMSNorm over all heads' outputs before o_proj (its attn_sub_norm)


def layer_sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """transformers' rule: `sliding_window` (which Qwen2/3 configs set to None unless `use_sliding_window`) applies
    to the layers `layer_types` marks "sliding_attention" (derived from `max_window_layers` when not given), or to
    every layer when the config has no `layer_types`."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and layer_types[layer_idx] != "sliding_attention"):
        return None
    return window


def llama4_query_scale(floor_scale: float, attn_scale: float, offset: float
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Llama 4's attention temperature (AttentionOptions.query_scale): the query at position p scaled by
    1 + attn_scale * log(1 + floor((p + offset) / floor_scale)); offset 1 (Llama 4) or 0 (Ministral 3)."""
    def scale(positions: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((positions.float() + offset) / floor_scale)) * attn_scale + 1.0
    return scale


def keep_in_fp32_(module: nn.Module, names: tuple[str, ...]) -> None:
    """transformers' `_keep_in_fp32_modules(_strict)` on a model being built: module's parameters whose dotted name
    holds one of names (a module's or a parameter's, matched whole) to fp32, whatever the dtype the rest is built in
    (the checkpoint's tensors are then cast to them on loading)."""
    for name, param in module.named_parameters():
        if any(f".{kept}." in f".{name}." for kept in names):
            param.data = param.data.float()


def scale_query(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [tokens, heads, head_dim] times its token's fp32 factor (AttentionOptions.query_scale), the product rounded
    to q's dtype, as transformers' Llama4TextAttention does (its Ministral 3 and Mistral 4 round the factor first: the
    same in fp32; Beam's the same as Llama 4)."""
    return (q * scale[:, None, None]).to(q.dtype)


class LlamaAttention(nn.Module):
    qkv_class: type[QKVParallelLinear] = QKVParallelLinear  # GPT-NeoX's loads its per-head checkpoint layout
    o_proj_class: type[RowParallelLinear] = RowParallelLinear  # GPT-2's loads its transposed weight
    attn_class: type[Attention] = Attention  # Gemma 4's keeps the step's K/V for the layers that reuse them

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__()
        num_heads = options.num_heads or config.num_attention_heads
        # GPT-NeoX's config has no num_key_value_heads: as many as query heads.
        num_kv_heads = options.num_kv_heads or getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = options.head_dim or getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # With an output gate, each head's query and gate rows load as two consecutive "heads" of q.
        self.q_factor = 2 if options.output_gate else 1
        qkv_class = KeyAsValueQKVParallelLinear if options.key_as_value else self.qkv_class
        self.v_head_dim = options.v_head_dim or self.head_dim
        self.qkv_proj = qkv_class(config.hidden_size, self.head_dim, num_heads * self.q_factor, num_kv_heads,
                                  options.qkv_bias, v_head_size=self.v_head_dim)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // self.q_factor, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.v_size = self.num_kv_heads * self.v_head_dim
        self.value_scale = options.value_scale
        self.o_proj = self.o_proj_class(num_heads * self.v_head_dim, config.hidden_size, options.o_bias)
        self.gate_activation, self.gate_per_head = options.gate_activation, options.gate_per_head
        if self.gate_activation is not None:  # column-parallel over the heads, as q
            self.g_proj = ColumnParallelLinear(config.hidden_size, num_heads * (1 if self.gate_per_head else
                                                                                  self.head_dim))
        self.gate_bias = (nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if options.gate_bias
                          else None)
        self.rotary_emb = (get_rope(config, self.head_dim, config.max_position_embeddings, options.rope_layer_type,
                                    options.rope_interleaved, options.rotary_dim, options.rope_theta,
                                    options.rope_reversed, options.rope_fp64, options.rope_scaled,
                                    options.rope_in_dtype)
                           if options.rope else None)
        scale = self.head_dim ** -0.5 if options.scale is None else options.scale
        self.attn = self.attn_class(self.num_heads, self.head_dim, scale, self.num_kv_heads, options.sliding_window,
                                    options.logits_soft_cap, sinks=options.sinks, encoder_only=options.encoder_only,
                                    alibi_slopes=options.alibi_slopes,
                                    attention_chunk_size=options.attention_chunk_size)
        if options.qk_norm:
            norm_class = options.qk_norm_class or RMSNorm
            self.q_norm, self.k_norm = (norm_class(self.head_dim, config.rms_norm_eps) for _ in range(2))
        self.qk_norm, self.qk_norm_after_rope = options.qk_norm, options.qk_norm_after_rope
        self.clip_qkv = options.clip_qkv
        self.query_scale = options.query_scale
        # The factor in the dtype the model is built in, as transformers' buffer holds it.
        self.qk_scale = None if options.qk_scale is None else torch.tensor(options.qk_scale, device="cpu").item()
        self.value_norm_eps = config.rms_norm_eps if options.value_norm else None
        self.attn_sub_norm = (ShardedRMSNorm(num_heads * self.head_dim, config.rms_norm_eps) if options.output_norm
                              else None)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size * self.q_factor, self.kv_size, self.v_size], -1)
        q = q.view(-1, self.num_heads, self.head_dim * self.q_factor)
        if self.q_factor == 2:
            q, gate = q.chunk(2, -1)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.value_norm_eps is not None:
            v = rms_normalize(v.view(-1, self.num_kv_heads, self.head_dim), self.value_norm_eps)
        rotate = positions is not None and self.rotary_emb is not None  # no: an encoder pass (LLM.embed), NoPE layer
        norms_in_rotation = self.qk_norm and rotate and not self.qk_norm_after_rope  # one pass on the CPU path
        if rotate:
            q, k = self.rotary_emb(positions, q, k, *((self.q_norm, self.k_norm) if norms_in_rotation else ()))
        if self.qk_norm and not norms_in_rotation:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.query_scale is not None and positions is not None:
            q = scale_query(q, self.query_scale(positions))
        if self.qk_scale is not None:
            q, k = q * self.qk_scale, k * self.qk_scale
        if self.value_scale is not None:
            v = v * self.value_scale
        if self.v_head_dim != self.head_dim:
            return self.o_proj(self.narrow_value_attention(q, k, v, meta))
        o = self.attn(q, k, v, meta)
        if self.q_factor == 2:
            o = o * torch.sigmoid(gate.flatten(1))
        if self.gate_activation is not None:
            o = self.gate_output(o, x)
        if self.attn_sub_norm is not None:
            o = self.attn_sub_norm(o)
        return self.o_proj(o)

    def narrow_value_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
                               ) -> torch.Tensor:
        """Attention with values narrower than the keys, through the backends' equal widths: each value zero-padded
        to head_dim (the zeros average to zeros), each head's output cut back -> [tokens, heads * v_head_dim]."""
        v = F.pad(v.view(-1, self.num_kv_heads, self.v_head_dim), (0, self.head_dim - self.v_head_dim))
        o = self.attn(q, k, v, meta).view(-1, self.num_heads, self.head_dim)
        return o[..., :self.v_head_dim].flatten(1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Its own parameters, per head (the gate's bias; Dory's query and gate scales per channel): this rank's
        heads'."""
        load_rank_rows(param, loaded)

    def gate_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [tokens, heads * head size] times the gate g_proj computes from the layer's input x (also MLA's,
        deepseek_v2.py, whose heads' outputs are v_head_dim wide)."""
        gate = self.g_proj(x)
        if self.gate_bias is not None:
            gate = (gate.unflatten(1, (self.num_heads, -1)) + self.gate_bias[:, None]).flatten(1)
        gate = self.gate_activation(gate.float()).to(o.dtype)
        if self.gate_per_head:
            return (o.view(*gate.shape, -1) * gate[..., None]).flatten(1)
        return o * gate


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, intermediate_size: int | None = None, hidden_act: str | None = None,
                 bias: bool | None = None):
        super().__init__()
        bias = getattr(config, "mlp_bias", False) if bias is None else bias
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias)
        self.act_fn = get_act_and_mul(hidden_act or config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# (config, layer index) -> that layer's attention options / its MLP (forward(x [tokens, hidden]) -> same shape).
OptionsFactory = Callable[[PretrainedConfig, int], AttentionOptions]
MLPFactory = Callable[[PretrainedConfig, int], nn.Module]


class LlamaDecoderLayer(nn.Module):
    attention_class: type[nn.Module] = LlamaAttention  # built as (config, options); DeepSeek's MLA is another

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.self_attn = self.attention_class(config, options)
        self.mlp = mlp
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def attention(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                  meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output and the residual stream (the input norm adds the last layer's output to it)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn(positions, x, meta), residual

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.attention(positions, x, residual, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    decoder_layer: type[nn.Module] = LlamaDecoderLayer  # built as (config, attention options, mlp)

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__()
        self.embed_tokens = self.token_embedding(config)
        self.layers = nn.ModuleList(self.make_layer(config, i, attention_options, make_mlp)
                                    for i in range(self.num_layers(config)))
        self.norm = self.final_norm(config)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, attention_options: OptionsFactory,
                   make_mlp: MLPFactory) -> nn.Module:
        """Layer layer_idx, called as the layers are (positions, x, residual, meta) -> (x, residual)."""
        return self.decoder_layer(config, attention_options(config, layer_idx), make_mlp(config, layer_idx))

    @staticmethod
    def token_embedding(config: PretrainedConfig) -> nn.Module:
        """The token embeddings (Mllama's hold rows past the vocabulary, OPT-350m's are narrower than the layers)."""
        return VocabParallelEmbedding(config.vocab_size, config.hidden_size)

    @staticmethod
    def num_layers(config: PretrainedConfig) -> int:
        """How many decoder layers (LongCat-Flash's hold two attention sublayers each)."""
        return config.num_hidden_layers

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        """The norm after the last layer, called as the layers' norms are (x, residual) -> (out, residual)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The input of the first layer; positions: for absolute position embeddings (GPT-2's)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        x, residual = self.embed(input_ids, positions), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    model_class: type[LlamaModel] = LlamaModel
    lm_head_bias = False  # Phi's LM head has one
    lm_head_dtype: torch.dtype | None = None  # None: the model's (HY-V4's is fp32 in every dtype)
    lm_head_fp32_logits = False  # Ergo's 16-bit head accumulates fp32 logits (see ParallelLMHead)
    # Why the family takes no prompt embeddings (enable_prompt_embeds), if it does not: see prompt_embedding.
    prompt_embeds_refused: str | None = None
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sliding_window=layer_sliding_window(config, layer_idx),
                                rope_in_dtype=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)

    @staticmethod
    def lm_head_rows(config: PretrainedConfig) -> int:
        """The LM head's tokens: the vocabulary (Apertus 1.5's may be pruned to its first ids)."""
        return config.vocab_size

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.model = self.model_class(config, self.attention_options, self.make_mlp)
        self.lm_head = ParallelLMHead(self.lm_head_rows(config), config.hidden_size, self.lm_head_bias,
                                      self.lm_head_dtype, self.lm_head_fp32_logits)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        """Hidden states after the final norm, [tokens, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
