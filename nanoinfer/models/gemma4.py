"""Gemma 4 (text): Gemma 3's layer (gemma3.py: sandwich norms, sliding and full layers with their own ropes, q/k
norms, scaled embeddings, final-logit softcapping) with plain-weight RMSNorms (w, not 1 + w) everywhere, unscaled
attention scores (the q/k norms set their size), values normalized per head without a weight, wider heads (and,
optionally, fewer KV heads) on full layers, whose rope ("proportional") turns only the leading frequencies of the
whole head, values taken from the key projection on full layers with `attention_k_eq_v`, and a learned scalar
multiplying each layer's output. Its MoE variant runs, in every layer, the dense MLP and top-k routed experts side
by side, each with its own norms, the router reading the residual stream. E2B/E4B add per-layer embeddings (a
token's own small vector for every layer, mixed with a projection of its embedding, gating a residual branch at the
end of each layer) and, on their last `num_kv_shared_layers` layers, attention over the keys and values of the
last earlier layer of the same type (those layers compute and cache none, and their MLPs may be twice as wide).
Gemma 4 unified (`gemma4_unified_text`: the language model of the encoder-free multimodal release) is this model
without per-layer embeddings or experts, its config without their fields. Gemma 3n (gemma3n.py) is built on the
E-models' pieces."""
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import get_act
from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.fused_moe import FusedMoE, select_experts
from nanoinfer.layers.layernorm import OlmoRMSNorm, RMSNorm, rms_normalize
from nanoinfer.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from nanoinfer.layers.rotary_embedding import get_rope
from nanoinfer.models import gemma, gemma2
from nanoinfer.models.llama import (AttentionOptions, LlamaAttention, LlamaMLP, MLPFactory, OptionsFactory,
                                    layer_sliding_window)
from nanoinfer.models.vision_language import MEDIA_TOKEN_IDS


def per_layer_input_width(config: PretrainedConfig) -> int:
    """The width of each layer's own input (E2B/E4B's per-layer embeddings), 0 for none: Gemma 4 unified's text
    config drops the field."""
    return getattr(config, "hidden_size_per_layer_input", 0)


def has_moe_block(config: PretrainedConfig) -> bool:
    """Whether every layer runs experts beside its MLP: Gemma 4 unified's text config drops the field."""
    return getattr(config, "enable_moe_block", False)


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    gemma2.check_layer_types(config)
    # "vision": image tokens attend both ways among themselves; text alone is causal.
    if config.use_bidirectional_attention == "all":
        raise ValueError("use_bidirectional_attention='all' in the model config: only causal Gemma 4 is supported")
    if per_layer_input_width(config) and config.vocab_size_per_layer_input < config.vocab_size:
        raise ValueError(f"vocab_size_per_layer_input={config.vocab_size_per_layer_input} in the model config is "
                         f"below vocab_size={config.vocab_size}: some tokens would have no per-layer embedding")
    check_kv_sharing(config)
    if has_moe_block(config) and config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={config.hidden_activation!r} in the model config: Gemma 4's experts are "
                         "implemented with 'gelu_pytorch_tanh' only")


def check_kv_sharing(config: PretrainedConfig) -> None:
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    if missing := set(config.layer_types[first_shared:]) - set(config.layer_types[:first_shared]):
        raise ValueError(f"num_kv_shared_layers={config.num_kv_shared_layers} in the model config: no earlier layer "
                         f"of type {sorted(missing)} to reuse keys and values from")


def kv_source(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The layer whose keys and values layer `layer_idx` attends over, where it reuses another's (transformers'
    `kv_sharing_modes`: the last layer of its type before the shared ones); None where it computes its own."""
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    if layer_idx < first_shared:
        return None
    layer_type = config.layer_types[layer_idx]
    return max(i for i in range(first_shared) if config.layer_types[i] == layer_type)


def kv_sharing_mode(config: PretrainedConfig, layer_idx: int) -> str | None:
    """transformers' names: "reuse" (another layer's keys and values), "store" (keys and values others reuse)."""
    if kv_source(config, layer_idx) is not None:
        return "reuse"
    sources = {kv_source(config, i) for i in range(config.num_hidden_layers)}
    return "store" if layer_idx in sources else None


@dataclass(frozen=True)
class Gemma4AttentionOptions(AttentionOptions):
    kv_sharing: str | None = None  # kv_sharing_mode's


def kv_sharing_attention_options(config: PretrainedConfig, layer_idx: int) -> Gemma4AttentionOptions:
    """Scores unscaled (the q/k norms set their size), (w) q/k norms, a weightless value norm, the rope and window
    of the layer's type, keys and values maybe shared with another layer: Gemma 3n's attention, and Gemma 4's but
    for the head sizes."""
    layer_type = config.layer_types[layer_idx]
    bias = config.attention_bias
    return Gemma4AttentionOptions(
        qkv_bias=bias, o_bias=bias, scale=1.0, qk_norm=True, qk_norm_class=OlmoRMSNorm, value_norm=True,
        rope_layer_type=layer_type, sliding_window=layer_sliding_window(config, layer_idx),
        kv_sharing=kv_sharing_mode(config, layer_idx))


def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    """kv_sharing_attention_options with the layer's head size and KV heads (transformers' per-layer config: wider
    on full layers). The full layers' "proportional" rope spans the whole head, its frequencies past
    partial_rotary_factor zero (those pairs, i and i + head_dim / 2, do not turn): transformers' function gives all
    head_dim / 2 of them, and the table turns as many pairs."""
    layer = config.per_layer_config[layer_idx]
    key_as_value = config.attention_k_eq_v and config.layer_types[layer_idx] == "full_attention"
    return replace(kv_sharing_attention_options(config, layer_idx), head_dim=layer.head_dim,
                   num_kv_heads=layer.num_key_value_heads, key_as_value=key_as_value)


class QueryParallelLinear(ColumnParallelLinear):
    """A query projection alone, named `qkv_proj` as the other layers' so that the checkpoint's q_proj reaches it
    (the "q" shard of Gemma4ForCausalLM.packed_modules_mapping)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.num_shards = 1

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id != "q":
            raise ValueError(f"a {shard_id or 'stacked qkv'} projection for a layer that reuses another's keys and "
                             "values")
        super().weight_loader(param, loaded)


class Gemma4ReusedKVAttention(nn.Module):
    """A layer attending with its own queries over the keys and values another layer (`source`, set by the model)
    computed this step and cached before: the source's attention runs it, with the same heads, window and cache
    (Kolibri 1.1's NoPE layers: options.rope False)."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__()
        num_heads, self.head_dim = config.num_attention_heads, options.head_dim or config.head_dim
        self.qkv_proj = QueryParallelLinear(config.hidden_size, num_heads * self.head_dim, options.qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, options.o_bias)
        self.q_norm = (options.qk_norm_class or RMSNorm)(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = (get_rope(config, self.head_dim, config.max_position_embeddings, options.rope_layer_type)
                           if options.rope else None)
        self.source: tuple[Gemma4KVSource, ...] = ()  # in a tuple: the source belongs to its own layer's module

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        rotate = positions is not None and self.rotary_emb is not None
        q = self.rotary_emb.rotate(positions, q, self.q_norm) if rotate else self.q_norm(q)
        return self.o_proj(self.attend(q, meta))

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [tokens, heads, head_dim] over the source's keys and values."""
        source = self.source[0]
        return source.attend(q, *source.step_kv, meta)


class Gemma4KVSource(Attention):
    """The attention of a layer whose keys and values later layers reuse: it keeps this step's, which their
    queries need beside the cached ones (the cache holds them too, but in blocks, and of the past only)."""

    step_kv: tuple[torch.Tensor, torch.Tensor]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        self.step_kv = k, v
        return super().forward(q, k, v, meta)


class PerLayerEmbeddings(nn.Module):
    """Gemma 4's and Gemma 3n's per-layer inputs: for every token and layer, (its row of a second embedding, scaled
    by sqrt(width), + the RMS-normed projection of its main embedding, scaled by hidden_size ** -0.5) / sqrt(2).
    Ids past the second embedding's table (Gemma 3n's multimodal ones; Gemma 4 refuses such a table) take its row
    0, as transformers' Gemma 3n does. The projection is small (hidden x layers x width) and replicated on every
    rank."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_layers, self.width = config.num_hidden_layers, config.hidden_size_per_layer_input
        self.table_size = config.vocab_size_per_layer_input
        self.embed_tokens_per_layer = VocabParallelEmbedding(config.vocab_size_per_layer_input,
                                                             self.num_layers * self.width)
        self.per_layer_model_projection = ReplicatedLinear(config.hidden_size, self.num_layers * self.width)
        self.per_layer_projection_norm = OlmoRMSNorm(self.width, config.rms_norm_eps)
        # transformers rounds the embedding's scale to the model's dtype (the one this is built under).
        self.embed_scale = torch.tensor(self.width ** 0.5, dtype=torch.get_default_dtype(), device="cpu").item()
        self.projection_scale = config.hidden_size ** -0.5

    def forward(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """[tokens] and their main embeddings [tokens, hidden] -> [tokens, layers, width]."""
        shape = (input_ids.shape[0], self.num_layers, self.width)
        input_ids = input_ids.masked_fill(input_ids >= self.table_size, 0)
        own = self.embed_tokens_per_layer(input_ids).view(shape) * self.embed_scale
        projected = self.per_layer_model_projection(embeddings) * self.projection_scale
        return (self.per_layer_projection_norm(projected.view(shape)) + own) * 2 ** -0.5


class Gemma4KVSourceAttention(LlamaAttention):
    attn_class = Gemma4KVSource


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
        # In fp32 until the experts' outputs are weighted, as transformers keeps them.
        weights, ids = select_experts(logits.float(), self.top_k, renormalize=True)
        return weights * self.per_expert_scale[ids].float(), ids


class PerLayerInputDecoderLayer(gemma2.Gemma2DecoderLayer):
    """Gemma 2's sandwich norms (plain-weight RMSNorms here) around an attention that may reuse, or keep for reuse,
    keys and values (kv_sharing), and, with per-layer embeddings, the branch that feeds the layer its own input: the
    parts Gemma 4's and Gemma 3n's (gemma3n.py) layers share."""

    norm_class = OlmoRMSNorm

    def __init__(self, config: PretrainedConfig, options: Gemma4AttentionOptions, mlp: nn.Module):
        # Set before nn.Module's __init__ (a plain attribute), read by LlamaDecoderLayer's.
        self.attention_class = {"reuse": Gemma4ReusedKVAttention, "store": Gemma4KVSourceAttention}.get(
            options.kv_sharing, LlamaAttention)
        super().__init__(config, options, mlp)
        self.per_layer_width = per_layer_input_width(config)
        if self.per_layer_width:
            self.per_layer_input_gate = ReplicatedLinear(config.hidden_size, self.per_layer_width)
            self.per_layer_projection = ReplicatedLinear(self.per_layer_width, config.hidden_size)
            self.post_per_layer_input_norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
            self.act_fn = get_act(config.hidden_activation)

    def per_layer_branch(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden] gating this layer's per-layer input [tokens, width], projected back and normed."""
        gated = self.act_fn(self.per_layer_input_gate(x)) * per_layer_input
        return self.post_per_layer_input_norm(self.per_layer_projection(gated))


class Gemma4DecoderLayer(PerLayerInputDecoderLayer):
    """With `enable_moe_block`, the experts' output (from the residual stream, under their own pre-norm) joins the
    dense MLP's, each after a norm of its own; the layer's whole output (residual stream included) is scaled by
    `layer_scalar`, so each layer hands the next its sum rather than a pending residual add."""

    def __init__(self, config: PretrainedConfig, options: Gemma4AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.router: Gemma4Router | None = None
        if has_moe_block(config):
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

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, per_layer_input: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: the residual stream, summed; per_layer_input [tokens, width]: this layer's (with per-layer embeddings)."""
        x, residual = self.attention(positions, x, None, meta)
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        x = residual + self.post_feedforward_layernorm(self.feed_forward(x, residual))
        if self.per_layer_width:
            x = x + self.per_layer_branch(x, per_layer_input)
        return x * self.layer_scalar


class Gemma4Model(gemma.GemmaModel):
    decoder_layer = Gemma4DecoderLayer

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.per_layer_embeddings = PerLayerEmbeddings(config) if per_layer_input_width(config) else None
        for i, layer in enumerate(self.layers):
            if (source := kv_source(config, i)) is not None:
                layer.self_attn.source = (self.layers[source].self_attn.attn,)

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        x = self.embed(input_ids, positions)
        per_layer = self.per_layer_embeddings(input_ids, x) if self.per_layer_embeddings is not None else None
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, None if per_layer is None else per_layer[:, i], meta)
        return self.norm(x)


# The per-layer embeddings' checkpoint names (at the model's top level) and where they load here.
PER_LAYER_EMBEDDING_NAMES = {f"model.{name}.": f"model.per_layer_embeddings.{name}." for name in (
    "embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")}


def reused_kv_weight_suffixes(config: PretrainedConfig) -> tuple[str, ...]:
    """The key/value projections and key norms checkpoints keep for the layers reusing others' keys and values,
    which transformers ignores on load."""
    return tuple(f".layers.{i}.self_attn.{name}" for i in range(config.num_hidden_layers)
                 if kv_sharing_mode(config, i) == "reuse"
                 for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias", "k_norm.weight"))


class Gemma4ForCausalLM(gemma2.Gemma2ForCausalLM):
    """Checkpoints keep k_proj/v_proj/k_norm of the layers reusing others' keys and values; transformers ignores
    them, and so does this. The per-layer embeddings load at the model's top level (`model.embed_tokens_per_layer`,
    ...), which here is that module's."""

    model_class = Gemma4Model
    weight_name_substitutions = PER_LAYER_EMBEDDING_NAMES
    # transformers' Gemma4ForConditionalGeneration softcaps its logits as the text model does (Gemma 3's wrapper
    # does not): the vision-language reading keeps compute_logits (see vision_language.py).
    wrapper_scales_logits = True
    check_config = staticmethod(check_config)
    attention_options = staticmethod(attention_options)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        # transformers' Gemma4ForConditionalGeneration embeds (both embeddings) its image, video and audio placeholder
        # ids as the pad token where no media come with them: always, here. The text model's config has none.
        media = [getattr(config, name) for name in MEDIA_TOKEN_IDS if getattr(config, name, None) is not None]
        self.media_token_ids = torch.tensor(media, dtype=torch.long) if media else None
        self.pad_token_id = config.pad_token_id
        self.ignored_weight_suffixes = reused_kv_weight_suffixes(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        if self.media_token_ids is not None:
            input_ids = input_ids.masked_fill(torch.isin(input_ids, self.media_token_ids), self.pad_token_id)
        return super().forward(input_ids, positions, meta)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        wide = config.use_double_wide_mlp and kv_sharing_mode(config, layer_idx) == "reuse"
        return LlamaMLP(config, config.intermediate_size * (2 if wide else 1), config.hidden_activation)
