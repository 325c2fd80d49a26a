"""Kolibri 1.1 (`Kolibri1_1ForCausalLM`, Aleph Alpha's): Kolibri-1 (kolibri1.py) whose full layers are indexed ones:
NoPE attention over NVFP4-rounded keys and values, each query over its sink, local and `index_topk` best keys as a
weightless indexer scores them (the layer's own first query heads against key head 0), those of `index_layers` first
pooling each query's best blocks of keys for the later ones to rescore. Indexed layers may attend over an earlier
one's keys and values (`kv_source_layers`, as Gemma 4's shared KV: gemma4.py), and `mlp_only_layers` have a dense MLP.
As DeepSeek sparse attention (deepseek_v32.py), the selection is a mask on the PyTorch backend only."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.models.config_checks import check_each_in, config_source
from nanoinfer.models.deepseek_v32 import SparseStep, sparse_rows, sparse_step
from nanoinfer.models.gemma4 import Gemma4AttentionOptions, Gemma4KVSource, Gemma4ReusedKVAttention
from nanoinfer.models.glm4 import Glm4DecoderLayer, Glm4Model
from nanoinfer.models.kolibri1 import Kolibri1ForCausalLM
from nanoinfer.models.llama import LlamaAttention, LlamaMLP, MLPFactory, OptionsFactory, layer_sliding_window
from nanoinfer.utils.dist import tp_group, tp_rank, tp_size

_LAYER_TYPES = ("sliding_attention", "indexed_attention")


def nvfp4_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to NVFP4 and back (transformers' nvfp4_fake_quantize), in x's dtype: E2M1 values, to nearest with
    ties to even, times one E4M3 scale per 16 consecutive values of the last dimension (their largest magnitude / 6)."""
    blocks = x.float().unflatten(-1, (-1, 16))
    scale = (blocks.abs().amax(-1, keepdim=True) / 6).clamp(2 ** -9, 448).to(torch.float8_e4m3fn).float()
    scaled = blocks / scale
    magnitude = scaled.abs().clamp(max=6)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))  # E2M1's spacing
    return ((torch.round(magnitude / step) * step).copysign(scaled) * scale).flatten(-2).to(x.dtype)


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the k highest finite scores of each row, ties to the lowest indices (transformers' reference kernels'
    radix selection)."""
    k = min(k, scores.shape[-1])
    kth = scores.topk(k, -1).values[..., -1:]
    above = scores > kth
    tied = (scores == kth) & (kth > float("-inf"))
    free = k - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= free))


def first_row_over(limit: int, rows: int, context: int, causal: bool) -> int:
    """The first of a context's last `rows` queries that sees more than `limit` keys (rows if none): causally, the
    query at position p sees p + 1."""
    if context <= limit:
        return rows
    return max(0, limit + 1 - (context - rows + 1)) if causal else 0


class Indexer(nn.Module):
    """transformers' Kolibri1_1Indexer, weightless: a key's score for a query is the ReLU of the logits of the query's
    first index_num_heads heads against key head 0, summed, times head_dim ** -0.5 / index_num_heads, both rounded to
    NVFP4 first. With pool_source (the layers of index_layers), each query first pools the index_pool_size /
    index_compression blocks of keys whose NVFP4-rounded means score best (the block it is in scoring 0), kept on the
    step for the layers that rescore it; each query then attends to the index_topk best keys of its pool besides its
    first index_num_sink_tokens and last index_num_local_tokens. A query that sees no more keys than a pool, or than
    these, takes all of them. Rank 0 (which holds key head 0 and its query heads) selects for every rank."""
    per_step_host_state = True  # sparse_step reads each step's spans on the host: ModelRunner.model_capturable

    def __init__(self, config: PretrainedConfig, pool_source: bool):
        super().__init__()
        self.pool_source = pool_source
        self.num_heads, self.topk, self.block = config.index_num_heads, config.index_topk, config.index_compression
        self.pool_size, self.num_sinks, self.num_local = (config.index_pool_size, config.index_num_sink_tokens,
                                                          config.index_num_local_tokens)
        self.head_weight = config.head_dim ** -0.5 / config.index_num_heads
        self.rank, self.tp_size, self.tp_group = tp_rank(), tp_size(), tp_group()

    def forward(self, q: torch.Tensor, keys: list[torch.Tensor], step: SparseStep, causal: bool
                ) -> list[torch.Tensor]:
        """q [tokens, heads, head_dim] (this rank's heads), each sequence's keys of key head 0 [context, head_dim]
        -> each sequence's selection [rows, context] (True: attended)."""
        if self.rank != 0:
            return self.broadcast(None, step, q.device)
        pools = step.selection or [None] * len(keys)
        selections, pools = zip(*(self.select(q[start:start + n, :self.num_heads], seq_keys, causal, pool)
                                  for (start, n, _), seq_keys, pool in zip(step.spans, keys, pools)))
        step.selection = list(pools)
        return list(selections) if self.tp_size == 1 else self.broadcast(selections, step, q.device)

    def select(self, q: torch.Tensor, keys: torch.Tensor, causal: bool, pool: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A context's last rows' index queries [rows, index heads, head_dim] and keys [context, head_dim] -> their
        selection and their pool (this layer's with pool_source, else the last one's), [rows, context] each."""
        n, context = q.shape[0], keys.shape[0]
        positions = torch.arange(context, device=q.device)
        seen = positions[context - n:, None] + 1 if causal else torch.full((n, 1), context, device=q.device)
        visible = positions < seen
        queries = nvfp4_round(q.transpose(0, 1)).float()
        if self.pool_source:
            pool, first = visible.clone(), first_row_over(self.pool_size, n, context, causal)
            if first < n:
                pool[first:] = self.select_pool(queries[:, first:], keys, seen[first:], visible[first:])
        selected, first = visible.clone(), first_row_over(self.topk + self.num_sinks + self.num_local, n, context,
                                                          causal)
        if first < n:
            selected[first:] = self.select_keys(queries[:, first:], keys, seen[first:], visible[first:],
                                                pool[first:])
        return selected, pool

    def score(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[heads, rows, head_dim] fp32 queries against [keys, head_dim] fp32 keys -> [rows, keys], summed over the
        heads in transformers' order."""
        scores = queries.new_zeros(queries.shape[1], keys.shape[0])
        for head in queries:
            scores += (head @ keys.T).relu()
        return scores * self.head_weight

    def select_pool(self, queries: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, visible: torch.Tensor
                    ) -> torch.Tensor:
        """The pool of rows that see more than pool_size keys: their best complete blocks, the incomplete one they
        are in scoring 0."""
        blocks = keys.shape[0] // self.block
        means = keys[:blocks * self.block].float().unflatten(0, (blocks, self.block)).sum(1) / self.block
        scores = F.pad(self.score(queries, nvfp4_round(means)), (0, 1))
        ids = torch.arange(blocks + 1, device=keys.device)
        scores = torch.where(ids < seen // self.block, scores, 0.0)
        scores = scores.masked_fill(ids >= (seen + self.block - 1) // self.block, float("-inf"))
        chosen = top_k_mask(scores, self.pool_size // self.block).repeat_interleave(self.block, -1)
        return chosen[:, :keys.shape[0]] & visible

    def select_keys(self, queries: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, visible: torch.Tensor,
                    pool: torch.Tensor) -> torch.Tensor:
        """The keys of rows that see more than their budget: sinks, local tokens and the best of the rest of the
        pool."""
        scores = self.score(queries, nvfp4_round(keys).float())
        positions = torch.arange(keys.shape[0], device=keys.device)
        sinks, local = positions < self.num_sinks, positions >= seen - self.num_local
        candidates = pool & ~sinks & ~local
        chosen = top_k_mask(scores.masked_fill(~candidates, float("-inf")), self.topk)
        return (chosen | sinks | local) & visible

    def broadcast(self, selections: tuple[torch.Tensor, ...] | None, step: SparseStep, device: torch.device
                  ) -> list[torch.Tensor]:
        """Rank 0's selections (None on the other ranks) on every rank, in one tensor."""
        sizes = [n * context for _, n, context in step.spans]
        flat = (torch.cat([s.flatten() for s in selections]).to(torch.uint8) if selections is not None
                else torch.empty(sum(sizes), dtype=torch.uint8, device=device))
        dist.broadcast(flat, group=self.tp_group, group_src=0)
        return [part.view(n, context).bool() for part, (_, n, context) in zip(flat.split(sizes), step.spans)]


class IndexedKV(Gemma4KVSource):
    """An indexed layer's K/V cache and attention: each sequence's queries over its context's keys and values, both
    rounded to NVFP4 (the values as they are stored), each query over the keys an indexer selects (its own layer's,
    or that of a layer reading these keys and values); this step's kept for those layers."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, indexer: Indexer):
        super().__init__(num_heads, head_dim, scale, num_kv_heads)
        self.indexer = indexer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        return super().forward(q, k, nvfp4_round(v), meta)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata
               ) -> torch.Tensor:
        return self.attend_selected(q, k, v, meta, self.indexer)

    def attend_selected(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        indexer: Indexer) -> torch.Tensor:
        """q [tokens, this rank's heads * head_dim], this step's k and v -> [tokens, heads * head_dim]."""
        step = sparse_step(meta)
        q = q.view(-1, self.num_heads, self.head_dim)
        k, v = (t.view(-1, self.num_kv_heads, self.head_dim) for t in (k, v))
        contexts = [self.context(k, v, start, n, slots) for (start, n, _), slots in zip(step.spans, step.context_slots)]
        selections = indexer(q, [keys[:, 0] for keys, _ in contexts], step, meta.causal)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for (start, n, _), (keys, values), mask in zip(step.spans, contexts, selections):
            out[start:start + n] = sparse_rows(q[start:start + n], nvfp4_round(keys), values, mask, self.scale)
        return out

    def context(self, k: torch.Tensor, v: torch.Tensor, start: int, n: int, slots: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's keys and values [context, KV heads, head_dim]: its rows of this step's where they are its
        whole context, else its context read back from the cache."""
        if slots is None:
            return k[start:start + n], v[start:start + n]
        k_cache, v_cache = (cache.view(-1, self.num_kv_heads, self.head_dim) for cache in (self.k_cache, self.v_cache))
        return k_cache[slots], v_cache[slots]


@dataclass(frozen=True)
class Kolibri1_1AttentionOptions(Gemma4AttentionOptions):
    indexed: bool = False  # each query over the keys its indexer selects (NoPE)
    pool_source: bool = False  # its indexer pools new candidates (index_layers), else rescores the last one's


class IndexedAttention(LlamaAttention):
    """Kolibri-1's attention (per-head q/k norms) on an indexed layer with keys and values of its own."""

    def __init__(self, config: PretrainedConfig, options: Kolibri1_1AttentionOptions):
        super().__init__(config, options)
        self.attn = IndexedKV(self.num_heads, self.head_dim, self.attn.scale, self.num_kv_heads,
                              Indexer(config, options.pool_source))


class ReusedKVIndexedAttention(Gemma4ReusedKVAttention):
    """An indexed layer over an earlier one's keys and values, with its own indexer."""

    def __init__(self, config: PretrainedConfig, options: Kolibri1_1AttentionOptions):
        super().__init__(config, options)
        self.indexer = Indexer(config, options.pool_source)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        source = self.source[0]
        return source.attend_selected(q, *source.step_kv, meta, self.indexer)


class Kolibri1_1DecoderLayer(Glm4DecoderLayer):
    def __init__(self, config: PretrainedConfig, options: Kolibri1_1AttentionOptions, mlp: nn.Module):
        # Set before nn.Module's __init__ (a plain attribute), read by LlamaDecoderLayer's.
        self.attention_class = (ReusedKVIndexedAttention if options.kv_sharing == "reuse" else
                                IndexedAttention if options.indexed else LlamaAttention)
        super().__init__(config, options, mlp)


class Kolibri1_1Model(Glm4Model):
    decoder_layer = Kolibri1_1DecoderLayer

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        for layer, source in zip(self.layers, config.kv_source_layers):
            if isinstance(layer.self_attn, ReusedKVIndexedAttention):
                layer.self_attn.source = (self.layers[source].self_attn.attn,)


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot run, refused by name rather than run differently from transformers (whose
    config refuses the rest)."""
    check_each_in(config, "layer_types", _LAYER_TYPES)
    heads = config.num_attention_heads // tp_size()
    if "indexed_attention" in config.layer_types and config.index_num_heads > heads:
        raise ValueError(f"index_num_heads={config.index_num_heads} in {config_source(config)}: rank 0 selects "
                         f"every rank's keys with its own query heads, {heads} under tensor parallelism over "
                         f"{tp_size()} ranks")


def attention_options(config: PretrainedConfig, layer_idx: int) -> Kolibri1_1AttentionOptions:
    indexed = config.layer_types[layer_idx] == "indexed_attention"
    return Kolibri1_1AttentionOptions(qk_norm=True, sliding_window=layer_sliding_window(config, layer_idx),
                                      rope=not indexed, indexed=indexed, pool_source=layer_idx in config.index_layers,
                                      kv_sharing=config.kv_sharing_modes[layer_idx])


class Kolibri1_1ForCausalLM(Kolibri1ForCausalLM):
    model_class = Kolibri1_1Model
    check_config = staticmethod(check_config)
    attention_options = staticmethod(attention_options)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if layer_idx in config.mlp_only_layers:
            return LlamaMLP(config, config.mlp_only_intermediate_size)
        return Kolibri1ForCausalLM.make_mlp(config, layer_idx)
