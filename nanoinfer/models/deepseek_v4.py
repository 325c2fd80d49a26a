"""DeepSeek-V4 (`DeepseekV4ForCausalLM`), as transformers' deepseek_v4 runs it. Attention: a low-rank q (its latent
RMS-normed, each head RMS-normed without a weight) over ONE shared key that is also the value (K = V, MQA), rope on the
last qk_rope_head_dim dims of each head (interleaved pairs) and the output turned back by the query's angle, GPT-OSS's
sinks, and a grouped output projection (o_groups blocks of heads each to o_lora_rank, then one linear). Each query sees
its sliding window of keys and, on compressed layers, the entries of earlier windows of the sequence: a compressor pools
each closed window of `compress_rate` positions into one entry (a softmax over the window of learned gates plus a
position bias, then RMSNorm and rope at the window's start) that a query sees once the window is complete.
"heavily_compressed_attention" (HCA) sees every such entry; "compressed_sparse_attention" (CSA) pools overlapping
windows (each entry mixes its window with the window before, two projections per token) and sees only the index_topk
entries a lightning indexer (as DeepSeek-V3.2's, over the indexer's own compressed entries) scores best. The residual is
HY-V4's hyper-connections (hy_v4.py) with a stream mix (a doubly stochastic hc_mult x hc_mult matrix, Sinkhorn); every
MLP is a MoE (routed experts with clamped SwiGLU, sqrt(softplus) or sigmoid scores) plus a clamped shared expert, routed
by top k of score + correction bias or, on "hash_moe" layers, by a fixed table of experts per token id.

Nothing here is per-sequence state outside the KV cache: per token and layer the blocks hold the shared key and the
compressors' projections (IndexerKeyCache rows), from which each step pools the entries its queries see. Prefix-cache
hits, chunked prefill and preemption hence hold as for any KV cache; the price is pooling a context's windows again
at every step, O(context) as the attention itself. The attention runs on the PyTorch backend only (registry)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.fused_moe import clamped_silu_and_mul, select_experts_sigmoid_biased
from nanoinfer.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from nanoinfer.layers.rotary_embedding import RotaryEmbedding, get_rope
from nanoinfer.models.config_checks import check_each_in, config_source
from nanoinfer.models.deepseek_v2 import check_moe_config
from nanoinfer.models.deepseek_v3 import DeepseekV3MoE
from nanoinfer.models.deepseek_v32 import IndexerKeyCache, sparse_rows, sparse_step, window_mask
from nanoinfer.models.gpt_oss import GptOssRMSNorm
from nanoinfer.models.hy_v4 import HyperConnectedModel, collapse, fp32_parameter, stream_mixes
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM
from nanoinfer.models.minimax_m3 import MiniMaxM3MLP
from nanoinfer.utils.dist import tp_size

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCTIONS = {"sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(), "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class CompressedAttentionOptions(AttentionOptions):
    compress_rate: int = 0  # the windows a compressor pools (0: a sliding layer, no compressor)
    indexer: bool = False  # CSA: overlapping windows, entries chosen by the indexer


def rotate_tail(rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor, inverse: bool = False
                ) -> torch.Tensor:
    """x [tokens, heads, dim] with its last rope.rotary_dim dims rotated (inverse: turned back) by positions."""
    keep = x.shape[-1] - rope.rotary_dim
    return torch.cat([x[..., :keep], rope.rotate(positions, x[..., keep:].contiguous(), inverse=inverse)], -1)


class Compressor(nn.Module):
    """transformers' DeepseekV4HCACompressor / CSACompressor and its indexer's: per token a value and a gate of
    head_dim (overlap: two series each, Ca and Cb, 2 * head_dim), cached in the KV blocks; entry w pools window w's
    values by softmax(gate + ape) over the window (overlap: over window w-1's Ca and window w's Cb, 2 * rate slots),
    then its RMSNorm and rope at position w * rate. Replicated under tensor parallelism. Names as the Hub's."""

    def __init__(self, config: PretrainedConfig, head_dim: int, rate: int, overlap: bool, rope: RotaryEmbedding):
        super().__init__()
        self.head_dim, self.rate, self.overlap, self.rope = head_dim, rate, overlap, rope
        width = head_dim * (2 if overlap else 1)
        self.wkv = ReplicatedLinear(config.hidden_size, width)
        self.wgate = ReplicatedLinear(config.hidden_size, width)
        self.ape = fp32_parameter(rate, width)
        self.norm = GptOssRMSNorm(head_dim, config.rms_norm_eps)
        self.cache = IndexerKeyCache(2 * width)

    def store(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """This step's rows [tokens, 1, values + gates] into the cache; returned for the sequences read from it."""
        rows = torch.cat([self.wkv(x), self.wgate(x)], -1).unsqueeze(1)
        self.cache.store(rows, None, meta)
        return rows

    def entries(self, rows: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        """A sequence's entries [closed windows, head_dim] from its context's rows (this step's, or the cache's)."""
        rows = self.cache.keys(rows, slots)
        windows = rows.shape[0] // self.rate
        if not windows:
            return rows.new_empty(0, self.head_dim)
        kv, gate = rows[:windows * self.rate].view(windows, self.rate, -1).chunk(2, -1)
        gate = gate + self.ape
        if self.overlap:  # window w-1's Ca (none before window 0: weight 0), then window w's Cb
            kv, gate = (torch.cat([F.pad(t[:-1, :, :self.head_dim], (0, 0, 0, 0, 1, 0), value=fill),
                                   t[:, :, self.head_dim:]], 1) for t, fill in ((kv, 0.0), (gate, float("-inf"))))
        pooled = self.norm((kv * gate.softmax(1, dtype=torch.float32).to(kv.dtype)).sum(1))
        positions = torch.arange(windows, device=rows.device) * self.rate
        return rotate_tail(self.rope, positions, pooled.unsqueeze(1))[:, 0]


class Indexer(nn.Module):
    """transformers' DeepseekV4Indexer: DeepSeek-V3.2's lightning indexer over CSA's windows: its own overlapping
    compressor (index_head_dim) gives the keys, each query's score of entry w is sum over heads h of
    w_h * relu(q_h . entry) * index_head_dim^-1/2 (q from the query's latent, roped as the keys; w = weights_proj(x) *
    heads^-1/2), in fp32; the query keeps its index_topk best complete entries. Replicated (every rank selects
    alike)."""

    def __init__(self, config: PretrainedConfig, rate: int, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads)
        self.compressor = Compressor(config, self.head_dim, rate, True, rope)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, q_latent: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's queries [tokens, heads, dim], head weights [tokens, heads] and compressor rows."""
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)
        if positions is not None:
            q = rotate_tail(self.compressor.rope, positions, q)
        return q, self.weights_proj(x).float() * self.num_heads ** -0.5, self.compressor.store(x, meta)

    def select(self, q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor | None,
               visible: torch.Tensor) -> torch.Tensor:
        """A sequence's queries' choice [queries, entries] (True: attended) among the entries `visible` allows."""
        keys = self.compressor.entries(rows, slots)
        if keys.shape[0] <= self.topk:
            return visible
        scores = F.relu(torch.matmul(q.float(), keys.T.float())) * self.head_dim ** -0.5  # [queries, heads, entries]
        scores = (scores * weights.unsqueeze(-1)).sum(1)
        best = scores.masked_fill(~visible, float("-inf")).topk(self.topk, -1).indices
        return torch.zeros_like(visible).scatter_(-1, best, True) & visible


class GroupedLinear(ColumnParallelLinear):
    """transformers' DeepseekV4GroupedLinear (wo_a): o_groups blocks, each taking its group of heads to o_lora_rank;
    column-parallel, each rank its heads' groups."""

    def __init__(self, input_size: int, o_groups: int, o_lora_rank: int):
        super().__init__(input_size // o_groups, o_groups * o_lora_rank)
        self.groups = o_groups // tp_size()

    def process_weights_after_loading(self, batch_size_hint: int) -> None:
        """None: the groups' bmm reads the weight itself, not a packed copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, this rank's heads * head_dim] -> [tokens, this rank's groups * o_lora_rank]."""
        w = self.weight.view(self.groups, -1, self.weight.shape[1]).transpose(1, 2)
        return torch.bmm(x.view(x.shape[0], self.groups, -1).transpose(0, 1), w).transpose(0, 1).flatten(1)


class DeepseekV4Attention(nn.Module):
    """See the module docstring. q's projection and the output's grouped one are split by heads (groups) across
    ranks, wo_b row-parallel; the shared key, the compressors and the indexer are replicated."""
    per_step_host_state = True  # sparse_step reads each step's spans on the host: ModelRunner.model_capturable

    def __init__(self, config: PretrainedConfig, options: CompressedAttentionOptions):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads // tp_size(), config.head_dim
        self.eps, self.window = config.rms_norm_eps, options.sliding_window
        self.wq_a = ReplicatedLinear(config.hidden_size, config.q_lora_rank)
        self.q_norm = GptOssRMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(config.q_lora_rank, config.num_attention_heads * self.head_dim)
        self.wkv = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.norm = GptOssRMSNorm(self.head_dim, config.rms_norm_eps)
        self.wo_a = GroupedLinear(config.num_attention_heads * self.head_dim, config.o_groups, config.o_lora_rank)
        self.wo_b = RowParallelLinear(config.o_groups * config.o_lora_rank, config.hidden_size)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, 1, value_prefix_dim=self.head_dim,
                              sinks=True)
        self.attn.sinks = fp32_parameter(self.num_heads)  # fp32 in 16-bit models, as transformers keeps them
        self.rope = get_rope(config, config.qk_rope_head_dim, config.max_position_embeddings, options.rope_layer_type,
                             True, config.qk_rope_head_dim)
        rate = options.compress_rate
        self.compressor = Compressor(config, self.head_dim, rate, options.indexer, self.rope) if rate else None
        self.indexer = Indexer(config, rate, self.rope) if options.indexer else None

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)  # weightless norm
        kv = self.norm(self.wkv(x)).unsqueeze(1)
        if positions is not None:  # None: an encoder pass (see LLM.embed)
            q, kv = rotate_tail(self.rope, positions, q), rotate_tail(self.rope, positions, kv)
        self.attn.store(kv, None, meta)
        rows = None if self.compressor is None else self.compressor.store(x, meta)
        indexed = None if self.indexer is None else self.indexer(positions, x, q_latent, meta)
        out = q.new_empty(x.shape[0], self.num_heads, self.head_dim)
        step = sparse_step(meta)
        for (start, n, context), slots in zip(step.spans, step.context_slots):
            span = slice(start, start + n)
            keys, mask = self.sliding_keys(kv[span], slots, n, context, meta.causal)
            if self.compressor is not None:
                entries = self.compressor.entries(rows[span], slots)
                visible = self.visible(n, context, entries.shape[0], meta.causal, x.device)
                if indexed is not None:
                    visible = self.indexer.select(*(t[span] for t in indexed), slots, visible)
                keys, mask = torch.cat([keys, entries]), torch.cat([mask, visible], 1)
            keys = keys.unsqueeze(1)
            out[span] = sparse_rows(q[span], keys, keys, mask, self.attn.scale, self.attn.sinks).view(n, -1,
                                                                                                     self.head_dim)
        if positions is not None:  # V carries the keys' rotation: turned back at the query's position
            out = rotate_tail(self.rope, positions, out, inverse=True)
        return self.wo_b(self.wo_a(out.flatten(1)))

    def sliding_keys(self, kv: torch.Tensor, slots: torch.Tensor | None, n: int, context: int, causal: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's keys in its queries' windows [keys, head_dim] and their mask [queries, keys]."""
        first = max(0, context - n - self.window + 1) if causal else 0
        keys = kv[first:, 0] if slots is None else self.attn.k_cache.view(-1, self.head_dim)[slots[first:]]
        return keys, window_mask(n, context - first, self.window if causal else None, kv.device)

    def visible(self, n: int, context: int, entries: int, causal: bool, device: torch.device) -> torch.Tensor:
        """[queries, entries]: entry w once its window is complete, w < (position + 1) // rate (every one: a
        non-causal pass)."""
        complete = (torch.arange(context - n, context, device=device) + 1) // self.compressor.rate
        visible = torch.arange(entries, device=device) < complete.unsqueeze(1)
        return visible if causal else torch.ones_like(visible)


class MixingHyperConnection(nn.Module):
    """transformers' DeepseekV4HyperConnection (mHC): from the streams, a sublayer's input (their sum weighted by
    sigmoid(pre) + hc_eps), its output's weight in each stream (2 sigmoid(post)) and comb, a doubly stochastic
    [hc_mult, hc_mult] mix of the streams (a softmax + hc_eps, then hc_sinkhorn_iters column/row normalizations);
    in fp32 (their parameters kept fp32, as transformers keeps them)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.hc_mult, self.hc_eps, self.eps = config.hc_mult, config.hc_eps, config.rms_norm_eps
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.fn = fp32_parameter((2 + self.hc_mult) * self.hc_mult, self.hc_mult * config.hidden_size)
        self.base = fp32_parameter((2 + self.hc_mult) * self.hc_mult)
        self.scale = fp32_parameter(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [tokens, hc_mult, hidden] -> the sublayer's input [tokens, hidden], post [tokens, hc_mult], comb
        [tokens, hc_mult, hc_mult]."""
        hc = self.hc_mult
        split = [hc, hc, hc * hc]
        pre, post, comb = (w * s + b for w, s, b in zip(stream_mixes(streams, self.fn, self.eps).split(split, -1),
                                                         self.scale, self.base.split(split)))
        comb = torch.softmax(comb.unflatten(-1, (hc, hc)), -1) + self.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        return collapse(streams, torch.sigmoid(pre) + self.hc_eps), 2 * torch.sigmoid(post), comb

    @staticmethod
    def add_output(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The streams mixed by comb (stream k takes sum over j of comb[j, k] * stream j) plus the sublayer's output
        [tokens, hidden] times each stream's post weight, in the streams' dtype."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class DeepseekV4MoE(DeepseekV3MoE):
    """Routed experts (FusedMoE, each rank a slice of every expert; SwiGLU clamped at swiglu_limit) plus one shared
    expert of moe_intermediate_size (clamped alike). The top k of score + e_score_correction_bias, or (hashed:
    "hash_moe" layers) the experts tid2eid lists for the token id, each weighted by its score, renormalized, times
    routed_scaling_factor; scores sqrt(softplus(logit)) or sigmoid(logit) as scoring_func says."""
    fp32_router_weight = False  # transformers keeps its correction bias in fp32, not its router's weight

    def __init__(self, config: PretrainedConfig, hashed: bool):
        self.correction_bias = not hashed  # read by DeepseekV2MoE's router
        activation = clamped_silu_and_mul(config.swiglu_limit)
        super().__init__(config, shared_intermediate_size=0, activation=activation)
        self.shared_experts = MiniMaxM3MLP(config, config.moe_intermediate_size, activation)
        self.scoring = SCORING_FUNCTIONS[config.scoring_func]
        # The token id's experts (hashed); an integer table, replicated.
        self.tid2eid = nn.Parameter(torch.empty(config.vocab_size, self.top_k, dtype=torch.long),
                                    requires_grad=False) if hashed else None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.tid2eid is None:
            weights, ids = select_experts_sigmoid_biased(logits, self.top_k, self.gate.e_score_correction_bias, 1, 1,
                                                         True, self.scaling, scoring=self.scoring)
        else:
            ids = self.tid2eid[input_ids]
            weights = self.scoring(logits.float()).gather(1, ids)
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scaling
        return self.experts.run_experts(x, weights, ids) + self.shared_experts(x)

    def configure_routing(self, config: PretrainedConfig) -> None:
        check_moe_config(config, grouped=False)
        self.scaling = config.routed_scaling_factor


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, options: CompressedAttentionOptions, mlp: DeepseekV4MoE):
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, options)
        self.mlp = mlp
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc, self.ffn_hc = MixingHyperConnection(config), MixingHyperConnection(config)

    def forward(self, positions: torch.Tensor | None, streams: torch.Tensor, input_ids: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Called by HyperConnectedModel; the token ids are the hash layers' routing."""
        x, post, comb = self.attn_hc(streams)
        streams = self.attn_hc.add_output(streams, post, comb, self.self_attn(positions, self.input_layernorm(x), meta))
        x, post, comb = self.ffn_hc(streams)
        return self.ffn_hc.add_output(streams, post, comb, self.mlp(self.post_attention_layernorm(x), input_ids))


class DeepseekV4Model(HyperConnectedModel):
    decoder_layer = DeepseekV4DecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> GptOssRMSNorm:
        return GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot run, refused by name rather than run differently from transformers."""
    where = config_source(config)
    check_each_in(config, "layer_types", LAYER_TYPES)
    check_each_in(config, "mlp_layer_types", MLP_LAYER_TYPES)
    if config.scoring_func not in SCORING_FUNCTIONS:
        raise ValueError(f"scoring_func={config.scoring_func!r} in {where} is not supported; expected one of "
                         f"{tuple(SCORING_FUNCTIONS)}")
    if not config.swiglu_limit > 0:  # transformers clamps at it whatever it is (to zero, ...)
        raise ValueError(f"swiglu_limit={config.swiglu_limit!r} in {where} is not supported; expected > 0")
    if config.mlp_bias:
        raise ValueError(f"mlp_bias={config.mlp_bias!r} in {where} is not supported (the shared expert's biases)")
    counts = {"hc_mult": config.hc_mult, "hc_sinkhorn_iters": config.hc_sinkhorn_iters, "index_topk": config.index_topk,
              **{f"compress_rates[{t!r}]": config.compress_rates.get(t) for t in LAYER_TYPES[1:]
                 if t in config.layer_types}}  # as transformers, which reads a type's rate only where it has one
    for field, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}={value!r} in {where}; expected a positive int")
    if config.num_attention_heads % config.o_groups or config.o_groups % tp_size():
        raise ValueError(f"o_groups={config.o_groups!r} in {where} must divide num_attention_heads="
                         f"{config.num_attention_heads} and be divided by tensor_parallel_size={tp_size()}")
    if not 0 < config.qk_rope_head_dim <= min(config.head_dim, config.index_head_dim) or config.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={config.qk_rope_head_dim!r} in {where}: rope turns pairs of the last dims "
                         f"of head_dim={config.head_dim} and index_head_dim={config.index_head_dim}")


class DeepseekV4ForCausalLM(LlamaForCausalLM):
    model_class = DeepseekV4Model
    prompt_embeds_refused = "its first layers route experts by token id"
    # Only the shared expert's gate/up fuse.
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # transformers' save_pretrained writes the Hub's names (its conversion mapping): the attention's are kept, the
    # layer's and the MLP's taken to nanoinfer's, in this order.
    weight_name_substitutions = {
        "^head.": "lm_head.", ".attn_norm.": ".input_layernorm.", ".ffn_norm.": ".post_attention_layernorm.",
        ".hc_attn_": ".attn_hc.", ".hc_ffn_": ".ffn_hc.", ".attn.": ".self_attn.", ".attn_sink": ".attn.sinks",
        ".ffn.": ".mlp.", ".gate.bias": ".gate.e_score_correction_bias", ".gate.tid2eid": ".tid2eid",
        ".shared_experts.w1.": ".shared_experts.gate_proj.", ".shared_experts.w3.": ".shared_experts.up_proj.",
        ".shared_experts.w2.": ".shared_experts.down_proj."}
    ignored_weight_prefixes = ("mtp.", "model.mtp.")  # the multi-token-prediction layer, which transformers skips

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> CompressedAttentionOptions:
        layer_type = config.layer_types[layer_idx]
        compressed = layer_type != "sliding_attention"
        return CompressedAttentionOptions(sliding_window=config.sliding_window,
                                          rope_layer_type="compress" if compressed else "main",
                                          compress_rate=config.compress_rates[layer_type] if compressed else 0,
                                          indexer=layer_type == "compressed_sparse_attention")

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> DeepseekV4MoE:
        return DeepseekV4MoE(config, hashed=config.mlp_layer_types[layer_idx] == "hash_moe")

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
