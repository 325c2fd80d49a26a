"""Inkling (`InklingForCausalLM`; `InklingForConditionalGeneration` read as text): attention without rope whose scores
get "relative logits", a bias per query and backward distance: each query's hidden state, through r_proj, holds
d_rel numbers per head that mix a trained bank of bias-by-distance profiles (`rel_logits_proj.proj` [d_rel, extent])
into one bias for each distance below the extent (a sliding layer's window, else `rel_extent`), zero beyond. Queries
and keys are RMS-normed per head and scaled by 1 / head_dim; keys and values first go through a short causal
convolution plus its input, as do the attention's and the MLP's outputs, each with a per-sequence conv state. Sliding
layers have head counts of their own; full ones may scale their queries and biases by log(position) past a floor. The
embedding is RMS-normed; MLPs are dense (times a learned global_scale) or routed experts: sigmoid scores choose the
top k (plus a correction bias), then the chosen and the shared experts share one softmax over their log-sigmoids,
times route_scale and a learned global_scale. The final hidden states are divided by a muP width multiplier.

No paged kernel takes such a bias (flash-attn's, the Triton ones, the C decode kernel add at most ALiBi's slope times
distance): the layers attend on the PyTorch backend alone (registry.pytorch_only_attention), one SDPA per sequence
over its context read back from the cache, the bias (and the causal window) its float mask."""
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.attention.cpu import attention
from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, copy_weight
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer, load_rank_rows
from nanoinfer.models.config_checks import check_each_in, config_source
from nanoinfer.models.hybrid import HybridForCausalLM
from nanoinfer.models.llama import LlamaMLP
from nanoinfer.utils.dist import tp_group, tp_rank, tp_size

LAYER_TYPES = ("hybrid", "hybrid_sliding")
MLP_LAYER_TYPES = ("dense", "sparse")
# The Hub's layout of Inkling checkpoints (`model.llm.*`, `attn.wq_du`, ..., what transformers' save_pretrained writes
# for InklingForConditionalGeneration), renamed as transformers' conversion_mapping ("inkling_mm_model") reads it; the
# sconv weights, nn.Conv1d's [channels, 1, K] in either layout, as `conv_weight` (InklingConv). transformers 5.17's
# own layout has the embedding's norm beside it (`model.embed_norm`), 5.23's within (`model.embed_tokens.embed_norm`).
HUB_NAMES = {"^model.llm.embed_norm.": "model.embed_tokens.embed_norm.",
             "^model.embed_norm.": "model.embed_tokens.embed_norm.", "^model.llm.embed.": "model.embed_tokens.",
             "^model.llm.unembed.": "lm_head.", "^model.llm.": "model.", ".attn.wq_du.": ".self_attn.q_proj.",
             ".attn.wk_dv.": ".self_attn.k_proj.", ".attn.wv_dv.": ".self_attn.v_proj.",
             ".attn.wr_du.": ".self_attn.r_proj.", ".attn.wo_ud.": ".self_attn.o_proj.",
             ".attn.q_norm.": ".self_attn.q_norm.", ".attn.k_norm.": ".self_attn.k_norm.",
             ".attn.rel_logits_proj.": ".self_attn.rel_logits_proj.", ".attn.k_sconv.": ".self_attn.k_sconv.",
             ".attn.v_sconv.": ".self_attn.v_sconv.", "sconv.weight": "sconv.conv_weight",
             ".conv1d.weight": ".conv_weight", ".attn_norm.": ".input_layernorm.",
             ".mlp_norm.": ".post_attention_layernorm.", ".mlp.w2_md.": ".mlp.down_proj.",
             ".mlp.experts.w2_weight": ".mlp.experts.down_proj", ".mlp.gate.bias": ".mlp.gate.e_score_correction_bias",
             ".mlp.shared_experts.shared_w2_weight": ".mlp.shared_experts.down_proj"}
# The Hub's gate/up tensors, whose rows (along dim) alternate a gate row and an up row: (dim, the gate's and the up's
# names in transformers' layout, or one name for both stacked, gate rows first).
HUB_GATE_UP = {".mlp.w13_dn.weight": (0, (".mlp.gate_proj.weight", ".mlp.up_proj.weight")),
               ".mlp.experts.w13_weight": (1, (".mlp.experts.gate_up_proj",)),
               ".mlp.shared_experts.shared_w13_weight": (1, (".mlp.shared_experts.gate_proj",
                                                             ".mlp.shared_experts.up_proj"))}


class ResidualConv(RecurrentLayer):
    """A depthwise causal conv without bias, plus its input, over `divisor` (Inkling-2's output scale; Inkling's 1), in
    fp32: its taps and its state fp32 in every model dtype, as transformers keeps them. A conv that runs several times
    in one forward pass (Inkling-2-Loop's looped layers) keeps a state per run: its own for the first, those of `runs`
    (add_runs) for the others, the one `invocation` (set before each run) names."""

    def __init__(self, channels: int, kernel_size: int, divisor: float = 1.0):
        super().__init__(kernel_size, channels)
        self.divisor = divisor
        self.runs = nn.ModuleList()
        self.invocation = 0

    def add_runs(self, invocations: int) -> None:
        kernel_size, channels = self.conv_state_shape
        self.runs.extend(ResidualConv(channels, kernel_size + 1) for _ in range(invocations - 1))

    def slot_bytes(self, dtype: torch.dtype) -> int:
        return super().slot_bytes(self.ssm_dtype(dtype))

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        super().allocate_state(num_slots, self.ssm_dtype(dtype), device)

    def convolve(self, x: torch.Tensor, taps: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        """taps [channels, K], or each token's [tokens, channels, K] (oldest input first)."""
        state = self if self.invocation == 0 else self.runs[self.invocation - 1]
        state.reset_fresh_slots(batch)
        xf = x.float()
        return ((state.causal_conv(xf, taps, batch, silu=False) + xf) / self.divisor).to(x.dtype)


class InklingConv(ResidualConv):
    """The conv of static taps (checkpoint: `<name>.conv1d.weight` [channels, 1, K], loaded as `<name>.conv_weight`).
    sharded: the channels are this rank's KV heads' (keys, values), else all of the hidden size (the sublayer outputs,
    whole on every rank)."""

    def __init__(self, channels: int, kernel_size: int, sharded: bool, divisor: float = 1.0):
        super().__init__(channels, kernel_size, divisor)
        self.sharded = sharded
        self.conv_weight = nn.Parameter(torch.empty(channels, kernel_size, dtype=torch.float32), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        loaded = loaded[...]
        loaded = loaded.squeeze(1) if loaded.dim() == 3 else loaded  # nn.Conv1d's [out, in / groups = 1, K]
        if self.sharded:
            load_rank_rows(param, loaded)
        else:
            copy_weight(param, loaded)

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        return self.convolve(x, self.conv_weight, batch)


class RelativeLogits(nn.Module):
    """r [tokens, heads, d_rel] -> each token's bias per head and backward distance [tokens, heads, extent]."""

    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.proj = nn.Parameter(torch.empty(d_rel, extent), requires_grad=False)

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        return r @ self.proj


def log_scale(positions: torch.Tensor, floor: int, alpha: float) -> torch.Tensor:
    """transformers' Inkling logit scaling of a query at each position p: 1 + alpha * log(max((p + 1) / floor, 1)),
    fp32 [tokens, 1, 1]."""
    n = (positions + 1).float()
    return (1.0 + alpha * torch.log((n / floor).clamp(min=1.0))).view(-1, 1, 1)


def sequence_spans(meta: AttentionMetadata) -> list[tuple[int, int, int]]:
    """Each sequence's first row in the step, its rows and its context: derived once per step, kept on `meta`."""
    if meta.model_state is None:
        cu, ctx = meta.on_host.cu_seqlens_q.tolist(), meta.on_host.context_lens.tolist()
        meta.model_state = [(cu[i], cu[i + 1] - cu[i], ctx[i]) for i in range(meta.num_seqs)]
    return meta.model_state


def relative_bias_mask(rel: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None
                       ) -> torch.Tensor:
    """rel [n, heads, extent] (the queries' biases by distance), query positions [n, 1], key positions [keys] -> the
    float mask [heads, n, keys]: the bias at each distance below the extent, 0 beyond, -inf where the key is not seen
    (later, or outside the window)."""
    distance = q_pos - k_pos
    extent = rel.shape[-1]
    index = distance.clamp(0, extent - 1).expand(rel.shape[1], -1, -1)
    bias = rel.transpose(0, 1).gather(-1, index).masked_fill(distance >= extent, 0.0)
    hidden = distance < 0
    if window is not None:
        hidden |= distance >= window
    return bias.masked_fill(hidden, float("-inf"))


def attention_shape(config: PretrainedConfig, layer_idx: int) -> tuple[bool, int, int, int]:
    """Whether the layer is a sliding one, and its heads, KV heads and head size (the sliding layers' own)."""
    if config.layer_types[layer_idx] == "hybrid_sliding":
        return True, config.swa_num_attention_heads, config.swa_num_key_value_heads, config.swa_head_dim
    return False, config.num_attention_heads, config.num_key_value_heads, config.head_dim


class InklingAttention(nn.Module):
    per_step_host_state = True  # relative_attention reads each step's spans on the host: ModelRunner.model_capturable

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        sliding, heads, kv_heads, self.head_dim = attention_shape(config, layer_idx)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.r_proj = ColumnParallelLinear(config.hidden_size, heads * config.d_rel)
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size)
        self.k_sconv, self.v_sconv = (InklingConv(self.kv_size, config.conv_kernel_size, sharded=True)
                                      for _ in range(2))
        self.q_norm, self.k_norm = (RMSNorm(self.head_dim, config.rms_norm_eps) for _ in range(2))
        self.window = config.sliding_window_size if sliding else None
        self.rel_logits_proj = RelativeLogits(config.d_rel, self.window or config.rel_extent)
        floor = None if sliding else config.log_scaling_n_floor
        self.log_scaling = None if floor is None else (floor, config.log_scaling_alpha)
        # q and k are RMS-normed per head, hence 1 / head_dim rather than its square root (transformers' comment).
        self.attn = Attention(self.num_heads, self.head_dim, 1.0 / self.head_dim, self.num_kv_heads, self.window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch
                ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        k, v = self.k_sconv(k, batch), self.v_sconv(v, batch)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        rel = self.rel_logits_proj(self.r_proj(x).view(q.shape[0], self.num_heads, -1))
        if self.log_scaling is not None:  # in fp32, as transformers scales them
            tau = log_scale(positions, *self.log_scaling)
            q, rel = (q.float() * tau).to(q.dtype), (rel.float() * tau).to(rel.dtype)
        self.attn.store(k, v, meta)
        return self.o_proj(relative_attention(self.attn, positions, q, k, v, rel, meta))


def relative_attention(attn: Attention, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rel: torch.Tensor, meta: AttentionMetadata, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's queries over the keys they may see (this step's rows, or its context read back from `attn`'s
    cache), the relative bias as SDPA's float mask -> [tokens, heads * head_dim]. sinks [tokens, heads]: a logit per
    query and head that takes its share of the softmax and adds nothing (Inkling-2's), as a zero key and value."""
    heads, kv_heads, head_dim, window = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.sliding_window
    out = q.new_empty(q.shape[0], heads * head_dim)
    for i, (start, n, ctx) in enumerate(sequence_spans(meta)):
        rows = slice(start, start + n)
        first = 0 if window is None else max(0, ctx - n - window + 1)
        if ctx == n:  # the whole context is this step's (also in the warm-up, before the cache exists)
            ks, vs = k[start + first:start + n], v[start + first:start + n]
        else:
            slots = meta.context_slots(i, ctx)[first:]
            ks = attn.k_cache.view(-1, kv_heads, head_dim)[slots]
            vs = attn.v_cache.view(-1, kv_heads, head_dim)[slots]
        k_pos = torch.arange(first, ctx, device=q.device)
        mask = relative_bias_mask(rel[rows], positions[rows].unsqueeze(1), k_pos, window).to(q.dtype)
        if sinks is not None:
            zero = ks.new_zeros(1, kv_heads, head_dim)
            ks, vs = torch.cat([ks, zero]), torch.cat([vs, zero])
            mask = torch.cat([mask, sinks[rows].t().unsqueeze(-1).to(mask.dtype)], -1)
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[rows], ks, vs))
        out[rows] = attention(qs, ks, vs, mask.unsqueeze(0), False, attn.scale, None)[0].transpose(0, 1).flatten(1)
    return out


class InklingMLP(LlamaMLP):
    """A SwiGLU MLP times a learned scalar (`global_scale`)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.global_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.global_scale


class InklingRouter(nn.Module):
    """transformers' InklingTopkRouter, in fp32: logits over the routed experts, then the shared ones (`weight`
    [routed + shared, hidden]); the top k of sigmoid(routed logit) + e_score_correction_bias; the chosen and the shared
    experts weighted by a softmax over their log-sigmoids, times route_scale and `global_scale`."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_experts, self.top_k, self.route_scale = (config.n_routed_experts, config.num_experts_per_tok,
                                                          config.route_scale)
        experts = config.n_routed_experts + config.n_shared_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size), requires_grad=False)
        self.global_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> the routed experts' weights and ids [tokens, top k], the shared experts' weights [tokens, shared]."""
        logits = F.linear(x.float(), self.weight.float())
        routed, shared = logits[:, :self.num_experts], logits[:, self.num_experts:]
        ids = torch.topk(routed.sigmoid() + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        log_probs = F.logsigmoid(torch.cat([routed.gather(-1, ids), shared], -1))
        weights = torch.softmax(log_probs, -1) * self.route_scale * self.global_scale.float()
        weights = weights.to(x.dtype)
        return weights[:, :self.top_k], ids, weights[:, self.top_k:]


class InklingSharedExperts(nn.Module):
    """The shared experts as transformers stores them, stacked: gate_proj, up_proj [shared, inter, hidden], down_proj
    [shared, hidden, inter]; this rank's slice of inter. Each one's SwiGLU times its weight from the router, summed."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        if intermediate_size % tp_size():
            raise ValueError(f"shared expert intermediate size {intermediate_size} is not divisible by the "
                             f"tensor-parallel size {tp_size()}")
        inter = intermediate_size // tp_size()
        self.gate_proj, self.up_proj = (nn.Parameter(torch.empty(num_experts, inter, hidden_size),
                                                     requires_grad=False) for _ in range(2))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inter), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        dim = 2 if param is self.down_proj else 1
        size = param.shape[dim]
        if loaded.dim() != 3 or loaded.shape[dim] != size * tp_size():
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, parameter {tuple(param.shape)}"
                             f" on each of {tp_size()} ranks")
        copy_weight(param, loaded.narrow(dim, tp_rank() * size, size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up = x @ self.gate_proj.transpose(1, 2), x @ self.up_proj.transpose(1, 2)  # [shared, tokens, inter]
        h = F.silu(gate) * up * weights.t().unsqueeze(-1)
        return (h @ self.down_proj.transpose(1, 2)).float().sum(0).to(x.dtype)


class InklingMoE(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.gate = InklingRouter(config)
        self.experts = FusedMoE(config.n_routed_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=False, reduce_results=False)
        self.shared_experts = InklingSharedExperts(config.n_shared_experts, config.hidden_size,
                                                   config.moe_intermediate_size)
        self.tp_size, self.tp_group = tp_size(), tp_group()  # the scope is the model's construction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids, shared_weights = self.gate(x)
        y = self.experts.run_experts(x, weights, ids) + self.shared_experts(x, shared_weights)
        if self.tp_size > 1:  # the routed and the shared experts' partial sums, reduced once
            dist.all_reduce(y, group=self.tp_group)
        return y


class InklingDecoderLayer(nn.Module):
    """x + conv(attention(norm(x))), then + conv(mlp(norm(.))); the residual stream is added by the next norm."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.self_attn = InklingAttention(config, layer_idx)
        self.mlp = InklingMoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else InklingMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_sconv, self.mlp_sconv = (InklingConv(config.hidden_size, config.conv_kernel_size, sharded=False)
                                           for _ in range(2))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, batch: RecurrentBatch) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.attn_sconv(self.self_attn(positions, x, meta, batch), batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp_sconv(self.mlp(x), batch), residual


class NormedEmbedding(VocabParallelEmbedding):
    """The embedding, RMS-normed (`embed_norm`, of the family's norm class: Inkling-2's rounds as OlmoRMSNorm)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, eps: float, norm: type[RMSNorm] = RMSNorm):
        super().__init__(num_embeddings, embedding_dim)
        self.embed_norm = norm(embedding_dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(x))


def split_gate_up(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A Hub gate/up tensor (see HUB_GATE_UP) as transformers' gate and up ones, or as its stacked one."""
    suffix = next(s for s in HUB_GATE_UP if name.endswith(s))
    dim, targets = HUB_GATE_UP[suffix]
    pairs = tensor[...].unflatten(dim, (-1, 2))
    gate, up = pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
    stem = name[:-len(suffix)]
    if len(targets) == 1:
        yield stem + targets[0], torch.cat([gate, up], dim)
    else:
        yield from ((stem + target, t.contiguous()) for target, t in zip(targets, (gate, up)))


def check_attention_config(config: PretrainedConfig) -> str:
    """Refuses by name a layer type beyond Inkling's and KV heads that the ranks cannot share (Inkling's and
    Inkling-2's); returns where the config comes from."""
    where = config_source(config)
    check_each_in(config, "layer_types", LAYER_TYPES)
    # The keys' and values' convs hold a rank's KV heads' channels: each rank needs heads of its own.
    for name in ("num_key_value_heads", "swa_num_key_value_heads"):
        if getattr(config, name) % tp_size():
            raise ValueError(f"{name}={getattr(config, name)} in {where} does not split over "
                             f"tensor_parallel_size={tp_size()}")
    return where


def check_inkling_config(config: PretrainedConfig) -> None:
    """Refuses by name what the layers cannot run as transformers does."""
    where = check_attention_config(config)
    check_each_in(config, "mlp_layer_types", MLP_LAYER_TYPES)
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} in {where} is not supported; only 'silu' is implemented")
    # transformers' router takes the shared experts' logits off the end of its weight: it needs one at least.
    if "sparse" in config.mlp_layer_types and config.n_shared_experts < 1:
        raise ValueError(f"n_shared_experts={config.n_shared_experts} in {where}; Inkling's router needs one at least")


class InklingForCausalLM(HybridForCausalLM):
    weight_name_substitutions = HUB_NAMES
    ignored_weight_prefixes = ("model.mtp.",)  # the multi-token-prediction layers, which transformers skips too
    wrapper_scales_logits = True  # InklingForConditionalGeneration divides by the multiplier too

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return InklingDecoderLayer(config, layer_idx)

    def make_embedding(self, config: PretrainedConfig) -> nn.Module:
        return NormedEmbedding(config.vocab_size, config.hidden_size, config.rms_norm_eps)

    check_config = staticmethod(check_inkling_config)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        config.tie_word_embeddings = False  # `embed` and `unembed` apart in the checkpoints: transformers never ties
        # Inkling's muP multiplier, Inkling-2's softcap (each family has only its own).
        super().__init__(config, config.rms_norm_eps,
                         logits_scaling=getattr(config, "logits_mup_width_multiplier", None),
                         logit_softcap=getattr(config, "final_logit_softcapping", None))
        self.unpadded_vocab_size = config.unpadded_vocab_size

    @staticmethod
    def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, the Hub's gate/up ones split (the rest renamed by HUB_NAMES)."""
        for name, tensor in weights:
            if name.endswith(tuple(HUB_GATE_UP)):
                yield from split_gate_up(name, tensor)
            else:
                yield name, tensor

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The hidden states over the muP multiplier (here the logits, the same up to rounding); the head's rows past
        unpadded_vocab_size are padding, which transformers drops: -inf, never sampled."""
        logits = super().compute_logits(hidden_states)
        if logits is not None and self.unpadded_vocab_size is not None:
            logits[:, self.unpadded_vocab_size:] = -math.inf
        return logits
