"""Qwen4-Exp's text model (`Qwen4ExpForCausalLM`; the language model of `Qwen4ExpForConditionalGeneration`):
Qwen3.5-MoE's layers (qwen3_5.py: Gated DeltaNet, gated attention with Gemma q/k norms and partial rope, Qwen3-Next's
routed experts plus a gated shared expert) inside hyper-connections, with sparse attention and hashed n-gram
embeddings:

- Hyper-connections: each token carries `hc_count` residual streams. Before each sublayer a gated residual
  (GatedResidual) norms every stream, mixes them into the sublayer's input (per-element sigmoid weights from a low-rank
  projection, averaged over the streams) and weighs the sublayer's output into each stream; there is no other norm, and
  a last mix (without weights back) goes to the LM head.
- QSA on the attention layers: an indexer scores each query against its context's complete blocks of
  `indexer_compress_ratio` keys (the mean of their raw index keys, normed, roped at the block's first position), and
  the query attends only to its `indexer_budget / indexer_compress_ratio` best blocks and the tokens after the last
  complete block. The index keys are cached per layer in the KV blocks (deepseek_v32.IndexerKeyCache), the selection is
  a mask on the attention (minimax_m3.BlockSparseAttention), on the PyTorch backend only.
- Per-layer embeddings (PLE) on the layers `ple_layer_ids` names: the token's 2..`ngram_size`-grams (earlier tokens
  before an EOS, or before the sequence, read as EOS) are hashed into prime-sized tables, one per head; their
  embeddings give a value and one key per stream, the stream's own norm gates the value, and a dilated depthwise conv
  over the gated values adds local context. The previous `ngram_size - 1` tokens of each sequence and the conv's inputs
  are recurrent state (slots, as the delta rule's), so chunked prefill and preemption stay exact; prefix caching is off
  for this family as for every model with recurrent state.

Under tensor parallelism the delta rule, attention and experts shard as Qwen3.5-MoE's, the n-gram tables by rows (as
the token embedding); the hyper-connections, the QSA indexer and the rest of PLE are replicated."""
import math
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import GatedRMSNorm, GemmaRMSNorm
from nanoinfer.layers.linear import ReplicatedLinear, copy_weight
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer
from nanoinfer.layers.rotary_embedding import get_rope
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.deepseek_v32 import DSAOptions, IndexerKeyCache, SparseStep
from nanoinfer.models.hybrid import check_layer_config
from nanoinfer.models.llama import LlamaForCausalLM
from nanoinfer.models.minimax_m3 import MiniMaxM3Attention, rotary_dim
from nanoinfer.models.qwen2_moe import Qwen2MoeSparseMoeBlock
from nanoinfer.models.qwen3_5 import Qwen3_5GatedDeltaNet

# transformers' layer types; its config turns the Hub's "full_attention" into "indexed_attention" (5.17:
# "qwen_sparse_attention").
LAYER_TYPES = ("linear_attention", "indexed_attention", "qwen_sparse_attention", "full_attention")
OUTPUT_GATES = {"silu": F.silu, "sigmoid": torch.sigmoid}
QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


class GroupedGemmaRMSNorm(GemmaRMSNorm):
    """GemmaRMSNorm over each `group`-wide slice of the last dimension (transformers' Qwen4ExpTextRMSNorm with a
    group_size: every residual stream normed on its own), one weight over the whole width."""

    def __init__(self, hidden_size: int, group: int, eps: float):
        super().__init__(hidden_size, eps)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, self.group))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed.flatten(-2) * self.weight).to(x.dtype)


class GatedResidual(nn.Module):
    """transformers' Qwen4ExpTextGatedResidual: the streams [tokens, hc_count * hidden] -> a sublayer's input
    [tokens, hidden] and its output's weight in each stream [tokens, hc_count] (None without `combine`: the last
    mix)."""

    def __init__(self, config: PretrainedConfig, combine: bool = True):
        super().__init__()
        self.hc_count, self.hidden_size = config.hc_count, config.hidden_size
        width = self.hc_count * self.hidden_size
        self.hc_norm = GroupedGemmaRMSNorm(width, self.hidden_size, config.rms_norm_eps)
        self.input_mix_weight_down = ReplicatedLinear(width, config.hc_lowrank)
        self.input_mix_weight_up = ReplicatedLinear(config.hc_lowrank, width)
        self.block_inject_weight = ReplicatedLinear(width, self.hc_count) if combine else None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        normed = self.hc_norm(streams)
        mix = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.hc_count)))
        x = (self.per_stream(mix) * self.per_stream(normed)).mean(-2)
        if self.block_inject_weight is None:
            return x, None
        return x, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc_count)

    def per_stream(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.hc_count, self.hidden_size))

    @staticmethod
    def add_output(streams: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The sublayer's output [tokens, hidden] added to each stream times its weight."""
        return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class QSAIndexer(nn.Module):
    """transformers' Qwen4ExpTextQSAIndexer; replicated under tensor parallelism (every rank selects alike)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.indexer_n_heads, config.indexer_head_dim
        self.ratio = config.indexer_compress_ratio
        self.topk = config.indexer_budget // self.ratio
        self.num_kv_heads = config.num_key_value_heads  # the selection serves every KV head alike
        self.index_qk_proj = ReplicatedLinear(config.hidden_size, (self.num_heads + 1) * self.head_dim)
        self.q_layernorm, self.k_layernorm = (GemmaRMSNorm(self.head_dim, config.rms_norm_eps) for _ in range(2))
        # The attention's rope tables, over the index heads' leading dims.
        self.rotary_emb = get_rope(config, self.head_dim, config.max_position_embeddings, rotary_dim=rotary_dim(config))
        self.cache = IndexerKeyCache(self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, step: SparseStep, meta: AttentionMetadata
                ) -> list[torch.Tensor]:
        """Each sequence's selection [KV heads, rows, context] (True: attended)."""
        q, k = self.index_qk_proj(x).split([self.num_heads * self.head_dim, self.head_dim], -1)
        q = self.rotary_emb.rotate(positions, q.view(-1, self.num_heads, self.head_dim), self.q_layernorm)
        k = k.unsqueeze(1)  # cached raw: the blocks' means are normed and roped
        self.cache.store(k, None, meta)
        return [self.select(q[start:start + n], self.cache.keys(k[start:start + n], slots), context)
                for (start, n, context), slots in zip(step.spans, step.context_slots)]

    def block_keys(self, keys: torch.Tensor, blocks: int) -> torch.Tensor:
        """The context's raw keys [context, head_dim] -> its complete blocks' keys: means (in fp32, rounded back),
        normed, roped at each block's first position."""
        means = keys[:blocks * self.ratio].view(blocks, self.ratio, -1).float().mean(1).to(keys.dtype)
        starts = torch.arange(blocks, device=keys.device) * self.ratio
        return self.rotary_emb.rotate(starts, means.unsqueeze(1), self.k_layernorm).squeeze(1)

    def select(self, q: torch.Tensor, keys: torch.Tensor, context: int) -> torch.Tensor:
        """The context's last rows' queries [rows, heads, head_dim] -> their selection [KV heads, rows, context]: the
        best `topk` of the complete blocks before each (all of them where there are no more), then every later
        token up to its own."""
        blocks, first = context // self.ratio, context - q.shape[0]
        device = q.device
        own = torch.arange(first, context, device=device)
        complete = (own + 1) // self.ratio  # the complete blocks each row sees
        token = torch.arange(context, device=device)
        mask = (token >= (complete * self.ratio)[:, None]) & (token <= own[:, None])
        if blocks:
            scores = F.relu(torch.matmul(q.float(), self.block_keys(keys, blocks).float().T)).sum(1)
            scores = scores / math.sqrt(self.head_dim)
            keep = torch.arange(blocks, device=device) < complete[:, None]
            # The rows that see c > topk blocks (consecutive) choose among exactly those: a topk over rows of
            # transformers' length breaks ties (relu's zeros) as its topk per query does.
            for c in range(max((first + 1) // self.ratio, self.topk + 1), blocks + 1):
                rows = slice(max(c * self.ratio - 1, first) - first, min((c + 1) * self.ratio - 1, context) - first)
                chosen = scores[rows, :c].topk(self.topk, -1).indices
                keep[rows] = torch.zeros_like(keep[rows]).scatter_(-1, chosen, True)
            mask[:, :blocks * self.ratio] |= keep.repeat_interleave(self.ratio, -1)
        return mask.expand(self.num_kv_heads, -1, -1)


class Qwen4ExpAttention(MiniMaxM3Attention):
    """Qwen3.5's gated attention (Gemma q/k norms, partial rope) over the keys its QSA indexer selects."""
    indexer_class = QSAIndexer


class Qwen4ExpGatedDeltaNet(Qwen3_5GatedDeltaNet):
    """Qwen3.5's, its gated norm's activation `output_gate_type` (else hidden_act): SiLU or sigmoid."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, OUTPUT_GATES[output_gate_type(config)])


class TokenHistory(RecurrentLayer):
    """The last `ngram_size - 1` token ids of each sequence, in a slot (EOS at a sequence's start, as transformers
    pads its n-gram context)."""

    def __init__(self, ngram_size: int, eos_token_id: int):
        super().__init__(ngram_size, 1)
        self.eos_token_id = eos_token_id

    def slot_bytes(self, dtype: torch.dtype) -> int:
        return math.prod(self.conv_state_shape) * torch.long.itemsize

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.conv_state = torch.full((num_slots, *self.conv_state_shape), self.eos_token_id, device=device)

    def reset_fresh_slots(self, batch: RecurrentBatch) -> None:
        if batch.fresh_slots.numel():
            self.conv_state.index_fill_(0, batch.fresh_slots, self.eos_token_id)

    def windows(self, input_ids: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        """input_ids [tokens] -> each token's window [tokens, ngram_size]: the tokens before it, then itself."""
        self.reset_fresh_slots(batch)
        return self.causal_windows(input_ids.long().unsqueeze(1), batch)[:, 0]


def _splitmix64(value: int) -> int:
    mask = (1 << 64) - 1
    value = (value + 0x9E3779B97F4A7C15) & mask
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
    return value ^ (value >> 31)


def _is_prime(value: int) -> bool:
    if value % 2 == 0:
        return value == 2
    return value > 2 and all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def _primes_after(start: int, count: int) -> list[int]:
    primes, value = [], start
    while len(primes) < count:
        value += 1
        if _is_prime(value):
            primes.append(value)
    return primes


def hash_multipliers(config: PretrainedConfig, ple_index: int) -> torch.Tensor:
    """transformers' odd hash multiplier of each n-gram position for the `ple_index`-th PLE layer."""
    half_bound = max(1, ((1 << 63) - 1) // max(config.vocab_size, 1) // 2)
    base = config.seed + 10007 * ple_index
    return torch.tensor([2 * (_splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1)) % half_bound) + 1
                         for i in range(config.ngram_size)])


class NgramEmbedding(nn.Module):
    """transformers' Qwen4ExpTextNGramEmbedding: for n = 2..ngram_size, `heads_per_ngram` heads each hash the n-gram
    ending at the token (XOR of token * multiplier) modulo a prime of its own (the next primes after
    ngram_vocab_size_base, counted over every PLE layer's heads) into one table of their concatenated rows."""

    def __init__(self, config: PretrainedConfig, ple_index: int):
        super().__init__()
        self.ngram_size, self.heads_per_ngram = config.ngram_size, config.heads_per_ngram
        self.eos_token_id = eos_token_id(config)
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        sizes = _primes_after(config.ngram_vocab_size_base - 1, (ple_index + 1) * heads)[-heads:]
        self.register_buffer("layer_multipliers", hash_multipliers(config, ple_index), persistent=False)
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer("ngram_heads_offsets", torch.tensor([0, *sizes[:-1]]).cumsum(0), persistent=False)
        rows = -(-sum(sizes) // config.make_ngram_vocab_size_divisible_by) * config.make_ngram_vocab_size_divisible_by
        # Vocabulary-parallel as the token embedding: real checkpoints' tables hold ~90 GiB in all.
        self.ngram_embedding = VocabParallelEmbedding(rows, config.ple_embed_dim // heads)

    def history(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [tokens, ngram_size] (oldest first) -> [tokens, ngram_size]: the token, then the one s back for
        s = 1, 2, ...; EOS where an EOS lies between (or is) that one and the token."""
        before = windows[:, :-1]
        # An EOS at or after position j (before the token itself) cuts the token off from position j.
        cut = (before == self.eos_token_id).flip(-1).cumsum(-1).flip(-1) > 0
        return torch.cat([windows[:, -1:], before.masked_fill(cut, self.eos_token_id).flip(-1)], -1)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [tokens, ngram_size] -> the token's n-gram embeddings, concatenated [tokens, ple_embed_dim]."""
        history = self.history(windows) * self.layer_multipliers
        ids = []
        for n in range(2, self.ngram_size + 1):
            mixed = history[:, 0]
            for position in range(1, n):
                mixed = torch.bitwise_xor(mixed, history[:, position])
            heads = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
            ids.append(torch.remainder(mixed.unsqueeze(-1), self.ngram_heads_vocab_sizes[heads])
                       + self.ngram_heads_offsets[heads])
        return self.ngram_embedding(torch.cat(ids, -1)).flatten(-2)


class DilatedConv(RecurrentLayer):
    """A causal depthwise conv (no bias, then SiLU) whose taps lie `dilation` inputs apart: the dense conv of
    (kernel - 1) * dilation + 1 taps with zeros between, carried over in the state as the other convs. Checkpoint:
    nn.Conv1d's weight [channels, 1, kernel]."""

    def __init__(self, channels: int, kernel_size: int, dilation: int):
        super().__init__((kernel_size - 1) * dilation + 1, channels)
        self.dilation = dilation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param, loaded)

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        taps = self.weight.new_zeros(self.weight.shape[0], self.conv_state_shape[0] + 1)
        taps[:, ::self.dilation] = self.weight[:, 0]
        return self.causal_conv(x, taps, batch)


class PLELayer(nn.Module):
    """transformers' Qwen4ExpTextPLELayer: what the layer's n-gram embeddings add to the streams."""

    def __init__(self, config: PretrainedConfig, ple_index: int):
        super().__init__()
        self.hc_count, self.hidden_size = config.hc_count, config.hidden_size
        width = self.hc_count * self.hidden_size
        self.ple_embedding = NgramEmbedding(config, ple_index)
        self.key_proj = ReplicatedLinear(config.ple_embed_dim, width)
        self.value_proj = ReplicatedLinear(config.ple_embed_dim, self.hidden_size)
        self.norm_key, self.norm_query, self.norm_conv = (
            GroupedGemmaRMSNorm(width, self.hidden_size, config.rms_norm_eps) for _ in range(3))
        self.conv1d = DilatedConv(width, config.ple_conv_kernel_size, config.ngram_size)

    def forward(self, streams: torch.Tensor, windows: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        embeddings = self.ple_embedding(windows)
        key = self.norm_key(self.key_proj(embeddings)).unflatten(-1, (self.hc_count, self.hidden_size))
        query = self.norm_query(streams).unflatten(-1, (self.hc_count, self.hidden_size))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden_size)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # a signed square root
        gated = (torch.sigmoid(gate) * self.value_proj(embeddings).unsqueeze(-2)).flatten(-2)
        return gated + self.conv1d(self.norm_conv(gated), batch)


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.is_attention_layer = config.layer_types[layer_idx] != "linear_attention"
        if self.is_attention_layer:
            self.self_attn = Qwen4ExpAttention(config, DSAOptions(
                qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True, output_gate=True,
                qk_norm_class=GemmaRMSNorm))
        else:
            self.linear_attn = Qwen4ExpGatedDeltaNet(config)
        self.mlp = Qwen2MoeSparseMoeBlock(config)
        ple_ids = config.ple_layer_ids or []
        self.ple = PLELayer(config, ple_ids.index(layer_idx + 1)) if layer_idx + 1 in ple_ids else None
        self.attn_hyper_connection, self.mlp_hyper_connection = GatedResidual(config), GatedResidual(config)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch,
                windows: torch.Tensor | None) -> torch.Tensor:
        if self.ple is not None:
            streams = streams + self.ple(streams, windows, batch)
        x, weights = self.attn_hyper_connection(streams)
        x = self.self_attn(positions, x, meta) if self.is_attention_layer else self.linear_attn(x, batch)
        streams = GatedResidual.add_output(streams, weights, x)
        x, weights = self.mlp_hyper_connection(streams)
        return GatedResidual.add_output(streams, weights, self.mlp(x))


class Qwen4ExpModel(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.hc_count = config.hc_count
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen4ExpDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.hyper_connection_mixer = GatedResidual(config, combine=False)
        self.token_history = TokenHistory(config.ngram_size, eos_token_id(config)) if config.ple_layer_ids else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        batch = RecurrentBatch.from_metadata(meta)
        windows = None if self.token_history is None else self.token_history.windows(input_ids, batch)
        streams = self.embed_tokens(input_ids).repeat(1, self.hc_count)
        for layer in self.layers:
            streams = layer(positions, streams, meta, batch, windows)
        return self.hyper_connection_mixer(streams)[0]


def eos_token_id(config: PretrainedConfig) -> int:
    """The EOS that starts every n-gram context (transformers': the first of a list)."""
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def output_gate_type(config: PretrainedConfig) -> str:
    return config.output_gate_type or config.hidden_act


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot run, refused by name rather than run differently from transformers."""
    where = check_layer_config(config, silu=True, layer_types=LAYER_TYPES)  # the delta rule's conv, the experts
    for field in QSA_FIELDS:  # transformers' attention layers always build the indexer
        if not isinstance(getattr(config, field, None), int) or getattr(config, field) < 1:
            raise ValueError(f"{field}={getattr(config, field, None)!r} in {where}: Qwen4-Exp's attention needs its "
                             f"QSA indexer (a positive int)")
    if config.indexer_kv_heads != 1:
        raise ValueError(f"indexer_kv_heads={config.indexer_kv_heads} in {where} is not supported; expected 1")
    if config.indexer_budget % config.indexer_compress_ratio:
        raise ValueError(f"indexer_budget={config.indexer_budget} in {where} is not a multiple of "
                         f"indexer_compress_ratio={config.indexer_compress_ratio}")
    if rotary_dim(config) > config.indexer_head_dim:
        raise ValueError(f"indexer_head_dim={config.indexer_head_dim} in {where} is narrower than the rope's "
                         f"{rotary_dim(config)} dims")
    if output_gate_type(config) not in OUTPUT_GATES:
        raise ValueError(f"output_gate_type={output_gate_type(config)!r} in {where} is not supported; expected one "
                         f"of {tuple(OUTPUT_GATES)}")
    if not isinstance(config.hc_count, int) or config.hc_count < 2:
        raise ValueError(f"hc_count={config.hc_count!r} in {where}; expected an int above 1")
    if config.ple_layer_ids:
        check_ple_config(config, where)


def check_ple_config(config: PretrainedConfig, where: str) -> None:
    heads = (config.ngram_size - 1) * config.heads_per_ngram
    if heads < 1 or config.ple_embed_dim % heads:
        raise ValueError(f"ple_embed_dim={config.ple_embed_dim} in {where} does not split over the "
                         f"(ngram_size - 1) * heads_per_ngram={heads} n-gram heads")
    for layer_id in config.ple_layer_ids:
        if not 1 <= layer_id <= config.num_hidden_layers or config.layer_types[layer_id - 1] != "linear_attention":
            raise ValueError(f"ple_layer_ids={config.ple_layer_ids} in {where}: {layer_id} is not the (one-based) "
                             f"id of a linear_attention layer")
    if eos_token_id(config) is None:
        raise ValueError(f"eos_token_id={config.eos_token_id!r} in {where}: PLE's n-gram contexts start at an EOS")


# The n-gram tables as transformers' save_pretrained writes them: `split_ngram_parts` row blocks.
_NGRAM_PART = re.compile(r"(.*\.ngram_embedding)\.shard_(\d+)\.weight$")
_NGRAM_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class Qwen4ExpForCausalLM(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    ignored_weight_prefixes = ("mtp.",)  # multi-token-prediction weights, which transformers skips too

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__()
        self.split_ngram_parts, self.where = getattr(config, "split_ngram_parts", 1), config_source(config)
        self.model = Qwen4ExpModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    forward = LlamaForCausalLM.forward
    compute_logits = LlamaForCausalLM.compute_logits

    def convert_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each n-gram table's parts joined (in part order) once all have come; the hash buffers transformers saves
        checked against those derived from the config here (a checkpoint that hashes otherwise is refused)."""
        parts: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            if (part := _NGRAM_PART.match(name)) is not None:
                table = parts.setdefault(part[1], {})
                table[int(part[2])] = tensor[...]
                if len(table) == self.split_ngram_parts:
                    yield f"{part[1]}.weight", torch.cat([table.pop(i) for i in sorted(table)])
            elif name.endswith(_NGRAM_BUFFERS):
                self.check_ngram_buffer(name, tensor[...])
            else:
                yield name, tensor
        if any(parts.values()):
            raise ValueError(f"split_ngram_parts={self.split_ngram_parts} in {self.where}, but the checkpoint holds "
                             f"{sorted(len(t) for t in parts.values())} parts of n-gram tables {sorted(parts)}")

    def check_ngram_buffer(self, name: str, loaded: torch.Tensor) -> None:
        layer = re.search(r"layers\.(\d+)\.ple\.ple_embedding\.(\w+)$", name)
        ple = self.model.layers[int(layer[1])].ple if layer and int(layer[1]) < len(self.model.layers) else None
        if ple is None:
            raise ValueError(f"checkpoint tensor {name!r} in {self.where} has no PLE layer in {type(self).__name__}")
        derived = getattr(ple.ple_embedding, layer[2])
        if not torch.equal(loaded.to(derived), derived):
            raise ValueError(f"checkpoint tensor {name!r} in {self.where} holds {loaded.tolist()}; the config's "
                             f"n-gram hash gives {derived.tolist()}")
