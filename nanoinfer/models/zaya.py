"""ZAYA1 (`ZayaForCausalLM`, Zyphra's): attention through compressed convolutional attention (CCA), an MLP router and
residual scaling. CCA projects q and k, mixes them over the last tokens by a depthwise conv (`cca_time0` taps) then a
conv within each head (`cca_time1` taps, every channel of the head), and adds back residuals (each query head averaged
with its key head; each key head, its queries' average); q and k are then scaled to norm sqrt(head_dim), the keys
times a learned temperature per KV head, roped over half of each head (a rope per layer type: "hybrid",
"hybrid_sliding" with the config's window). Values come half from the token (`v_proj_current`), half from the token
before (`v_proj_delayed`). So CCA keeps per-sequence state beside the paged K/V: the last (cca_time0 - 1) +
(cca_time1 - 1) q/k projections and the previous token's input, in recurrent-state slots (prefix caching is off, as
for the hybrids). Each layer's MoE routes every token to one expert or to none (a skip class) by a small MLP over a
down-projection of its input plus (exponential depth averaging) the previous layer's; its top-1 by probability plus
a balancing bias, weighted by the probability (the experts' biases as the checkpoint holds them, the skip's -1 as
transformers sets it after loading, whatever the checkpoint says). The residual stream runs in fp32, each sublayer joining it as
(out + b) * s + (residual + b') * s'. Under tensor parallelism q, k, the convs and the KV heads shard by heads (the
value projections, half a KV head wide each, are replicated), o_proj and the experts as Llama's and Mixtral's."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, copy_weight
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer, RowShardedWeight, load_rank_rows
from nanoinfer.layers.rotary_embedding import get_rope
from nanoinfer.models.config_checks import check_each_in, config_source
from nanoinfer.models.llama import LlamaForCausalLM
from nanoinfer.utils.dist import tp_rank, tp_size

_LAYER_TYPES = ("hybrid", "hybrid_sliding")


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    where = config_source(config)
    check_each_in(config, "layer_types", _LAYER_TYPES)
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} in {where} is not supported; only 'silu' is implemented")
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, name) % tp_size():
            raise ValueError(f"{name}={getattr(config, name)} in {where} does not split over "
                             f"tensor_parallel_size={tp_size()}")


class ZayaCCAProjection(nn.Module):
    """x -> q [tokens, heads, head_dim], k and v [tokens, KV heads, head_dim] (this rank's heads), before the q/k
    norm. Its two recurrent states: `qk_window` (the q/k projections of the sequence's last tokens) and
    `previous_input` (its last input, zeros before its start, as transformers' delayed value of the first token)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        hidden, head_dim, tp = config.hidden_size, config.head_dim, tp_size()
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = heads // tp, kv_heads // tp, head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        self.q_proj = ColumnParallelLinear(hidden, q_width, bias)
        self.k_proj = ColumnParallelLinear(hidden, kv_width, bias)
        self.v_proj_current = ReplicatedLinear(hidden, kv_width // 2, bias)
        self.v_proj_delayed = ReplicatedLinear(hidden, kv_width // 2, bias)
        # nn.Conv1d's layouts: [channels, 1, cca_time0] and [channels, head_dim, cca_time1] (a group per head), the
        # channels q | k, each split by heads.
        segments = [(q_width, True), (kv_width, True)]
        self.conv_qk_depthwise = RowShardedWeight(segments, (1, config.cca_time0), bias=True)
        self.conv_qk_grouped = RowShardedWeight(segments, (head_dim, config.cca_time1), bias=True)
        channels = (self.num_heads + self.num_kv_heads) * head_dim
        self.qk_window = RecurrentLayer(config.cca_time0 + config.cca_time1 - 1, channels)
        self.previous_input = RecurrentLayer(2, hidden)
        self.kv_heads = slice(tp_rank() * self.num_kv_heads, (tp_rank() + 1) * self.num_kv_heads)

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, group = x.shape[0], self.num_heads // self.num_kv_heads
        for state in (self.qk_window, self.previous_input):
            state.reset_fresh_slots(batch)
        q, k = self.q_proj(x), self.k_proj(x)
        q_conv, k_conv = self.convolved(self.qk_window.causal_windows(torch.cat([q, k], -1), batch)).split(
            [q.shape[1], k.shape[1]], -1)
        q_res = (q.view(n, self.num_heads, -1) + k.view(n, self.num_kv_heads, 1, -1).expand(
            -1, -1, group, -1).reshape(n, self.num_heads, -1)) * 0.5
        k_res = q_res.view(n, self.num_kv_heads, group, -1).mean(-2)
        previous = self.previous_input.causal_windows(x, batch)[..., 0]
        v = torch.cat([self.v_proj_current(x), self.v_proj_delayed(previous)], -1).view(n, -1, self.head_dim)
        return (q_conv.view(n, -1, self.head_dim) + q_res, k_conv.view(n, -1, self.head_dim) + k_res,
                v[:, self.kv_heads].contiguous())

    def convolved(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [tokens, channels, cca_time0 + cca_time1 - 1] -> the two convs' output for each window's last
        token [tokens, channels]. Each conv sums in fp32 and rounds once, as F.conv1d (transformers')."""
        depthwise, grouped = self.conv_qk_depthwise, self.conv_qk_grouped
        dtype, acc = windows.dtype, torch.promote_types(windows.dtype, torch.float32)
        taps = windows.unfold(-1, depthwise.weight.shape[-1], 1).to(acc)  # [tokens, channels, cca_time1, cca_time0]
        y = ((taps * depthwise.weight.to(acc)).sum(-1) + depthwise.bias.to(acc)[:, None]).to(dtype)
        heads = y.view(y.shape[0], -1, self.head_dim, y.shape[-1]).to(acc)  # [tokens, heads, in, cca_time1]
        weight = grouped.weight.view(heads.shape[1], self.head_dim, self.head_dim, -1)  # [heads, out, in, taps]
        out = torch.einsum("nhit,hoit->nho", heads, weight.to(acc)).flatten(1) + grouped.bias.to(acc)
        return out.to(dtype)


class ZayaQKNorm(nn.Module):
    """q and k scaled to norm sqrt(head_dim) per head, the keys times `temp` (one per KV head: this rank's)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.scale = config.head_dim ** 0.5
        self.temp = nn.Parameter(torch.empty(config.num_key_value_heads // tp_size()), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_rank_rows(param, loaded)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.scale / x.norm(p=2, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).eps))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.normalized(q), self.normalized(k) * self.temp[:, None]


class ZayaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        layer_type = config.layer_types[layer_idx]
        self.qkv_proj = ZayaCCAProjection(config)
        self.qk_norm = ZayaQKNorm(config)
        heads, head_dim = self.qkv_proj.num_heads, config.head_dim
        self.rotary_emb = get_rope(config, head_dim, config.max_position_embeddings, layer_type)
        window = config.sliding_window if layer_type == "hybrid_sliding" else None
        self.attn = Attention(heads, head_dim, head_dim ** -0.5, self.qkv_proj.num_kv_heads, window)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        config.attention_bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch
                ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x, batch)
        q, k = self.rotary_emb(positions, *self.qk_norm(q, k))
        return self.o_proj(self.attn(q, k, v, meta))


class ZayaRouterMLP(nn.Module):
    def __init__(self, hidden_size: int, num_classes: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.fc1 = ReplicatedLinear(hidden_size, hidden_size, bias=True)
        self.fc2 = ReplicatedLinear(hidden_size, hidden_size, bias=True)
        self.out_proj = ReplicatedLinear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(x))))))


class ZayaRouter(nn.Module):
    """Replicated. Class num_experts is the skip (no expert: weight 0)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.num_experts = config.num_experts
        self.down_proj = ReplicatedLinear(config.hidden_size, config.router_hidden_size, bias=True)
        if layer_idx > 0:  # the first layer has no previous router state to add
            self.router_states_scale = nn.Parameter(torch.empty(config.router_hidden_size), requires_grad=False)
        self.router_mlp = ZayaRouterMLP(config.router_hidden_size, config.num_experts + 1, config.rms_norm_eps)
        self.balancing_biases = nn.Parameter(torch.empty(config.num_experts + 1, dtype=torch.float32),
                                             requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param, loaded)
        if param is self.balancing_biases:  # transformers' _init_weights sets the skip's after loading, as we must
            param.data[-1] = -1.0

    def forward(self, x: torch.Tensor, previous: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (top-1 weights [tokens, 1], expert ids [tokens, 1], this layer's router state for the next)."""
        state = self.down_proj(x)
        if previous is not None:
            state = state + previous * self.router_states_scale
        probs = torch.softmax(self.router_mlp(state), -1)
        ids = torch.topk(probs.float() + self.balancing_biases, 1, dim=-1)[1]
        weights = probs.gather(1, ids)
        skip = ids == self.num_experts
        return weights.masked_fill(skip, 0), ids.masked_fill(skip, 0), state


class ZayaMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.gate = ZayaRouter(config, layer_idx)
        self.experts = FusedMoE(config.num_experts, 1, config.hidden_size, config.moe_intermediate_size,
                                renormalize=False)  # routed by ZayaRouter

    def forward(self, x: torch.Tensor, router_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids, router_state = self.gate(x, router_state)
        return self.experts.run_experts(x, weights, ids), router_state


class ZayaResidualScaling(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        for name in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"):
            setattr(self, name, nn.Parameter(torch.empty(hidden_size), requires_grad=False))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return (x + self.hidden_states_bias) * self.hidden_states_scale + (
            residual + self.residual_bias) * self.residual_scale


class ZayaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ZayaAttention(config, layer_idx)
        self.post_attention_residual_scale = ZayaResidualScaling(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = ZayaMoE(config, layer_idx)
        self.post_mlp_residual_scale = ZayaResidualScaling(config.hidden_size)

    def forward(self, positions: torch.Tensor, residual: torch.Tensor, router_state: torch.Tensor | None,
                meta: AttentionMetadata, batch: RecurrentBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """residual: the fp32 stream; the sublayers run in the norms' dtype (the model's)."""
        dtype = self.input_layernorm.weight.dtype
        x = self.self_attn(positions, self.input_layernorm(residual.to(dtype)), meta, batch)
        residual = self.post_attention_residual_scale(x, residual)
        x, router_state = self.mlp(self.post_attention_layernorm(residual.to(dtype)), router_state)
        return self.post_mlp_residual_scale(x, residual), router_state


class ZayaModel(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.input_hidden_states_scale = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.input_hidden_states_bias = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(ZayaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        batch = RecurrentBatch.from_metadata(meta)
        x = self.embed_tokens(input_ids)
        residual = ((x + self.input_hidden_states_bias) * self.input_hidden_states_scale).float()
        router_state = None
        for layer in self.layers:
            residual, router_state = layer(positions, residual, router_state, meta, batch)
        return self.norm(residual.to(x.dtype))


class ZayaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_config(config)
        self.model = ZayaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=config.lm_head_bias)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    forward = LlamaForCausalLM.forward
    compute_logits = LlamaForCausalLM.compute_logits
