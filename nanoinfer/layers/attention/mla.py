"""MLA's split of a step (vLLM's): sequences attended absorbed over the latent cache (decodes, short chunks over long
contexts) and sequences attended over their context's decompressed per-head K/V (prefill), each with its metadata."""
from dataclasses import dataclass, replace

import numpy as np
import torch

from nanoinfer.layers.attention.metadata import AttentionMetadata

# A cached prefix is decompressed into a transient copy of [keys, heads, (qk_nope + qk_rope) + 2 * v_head_dim]: past
# this many bytes of them in a step, further sequences with a cached prefix stay absorbed. A step's own tokens
# always go decompressed: the warm-up that sized the KV cache measured them.
DECOMPRESS_PREFIX_BYTES = 256 << 20


@dataclass(frozen=True)
class MLADims:
    """The widths the split weighs (this rank's heads)."""
    num_heads: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int

    def decompressed_bytes_per_key(self, itemsize: int) -> int:
        """kv_b_proj's output, the key (its nope part and the broadcast rope key) and the value, per head."""
        return self.num_heads * (2 * self.nope_dim + self.rope_dim + 2 * self.v_dim) * itemsize


@dataclass
class MLASplit:
    absorbed: AttentionMetadata | None  # the sequences attended over the latent cache; None: none
    absorbed_rows: torch.Tensor | None  # their rows of the step's tokens; None: all rows
    # The sequences attended over decompressed K/V, which hold each one's whole context from row cu_seqlens_k[i]
    # (has_cached_prefix False); None: none.
    decompressed: AttentionMetadata | None
    decompressed_rows: torch.Tensor | None  # as absorbed_rows
    context_slots: torch.Tensor | None  # the cache slot of every decompressed key; None: the step's own latent rows


def decompress_pays(new: np.ndarray, prefix: np.ndarray, dims: MLADims) -> np.ndarray:
    """Per sequence, whether attending over decompressed K/V takes fewer multiply-adds (per head) than attending
    absorbed: decompressing a key costs kv_lora_rank * (nope + v), as absorbing a query into the latent space and
    up-projecting its output do; each score and value read then costs nope + rope + v instead of 2 * kv_lora_rank +
    rope, for prefix + (new + 1) / 2 keys per query on average (causal). A decode (new 1) stays absorbed, a fresh
    prompt (prefix 0) goes decompressed, a chunk over a long prefix from ~170 tokens on (DeepSeek's widths)."""
    per_key = dims.kv_lora_rank * (dims.nope_dim + dims.v_dim)
    saved_per_score = 2 * dims.kv_lora_rank - dims.nope_dim - dims.v_dim
    return prefix * per_key < new * (prefix + (new + 1) / 2) * saved_per_score


def mla_split(meta: AttentionMetadata, dims: MLADims, itemsize: int, backend) -> MLASplit:
    """The step's split, made by its first MLA layer (one host read of the sequence lengths) and kept on `meta`."""
    if meta.model_state is None:
        meta.model_state = _split(meta, dims, itemsize, backend)
    return meta.model_state


def _split(meta: AttentionMetadata, dims: MLADims, itemsize: int, backend) -> MLASplit:
    # Lengths from the metadata the host built: read back from the device, they would wait for the queued work.
    cu_q = meta.on_host.cu_seqlens_q.numpy().astype(np.int64)
    ctx = meta.on_host.context_lens.numpy().astype(np.int64)
    new = np.diff(cu_q)
    prefix = ctx - new
    take = decompress_pays(new, prefix, dims)
    cached = take & (prefix > 0)
    budget = DECOMPRESS_PREFIX_BYTES // dims.decompressed_bytes_per_key(itemsize)
    take &= ~cached | (np.cumsum(np.where(cached, ctx, 0)) <= budget)
    if not take.any():
        return MLASplit(meta, None, None, None, None)
    if take.all() and not meta.has_cached_prefix:  # fresh prompts: the step's keys are the contexts, as laid out
        return MLASplit(None, None, meta, None, None)
    decompressed, decompressed_rows = _subset(meta, take, cu_q, ctx, contiguous_keys=True)
    backend.prepare(decompressed)
    slots = _context_slots(meta, take, ctx) if (prefix[take] > 0).any() else None
    if take.all():
        return MLASplit(None, None, decompressed, None, slots)
    absorbed, absorbed_rows = _subset(meta, ~take, cu_q, ctx, contiguous_keys=False)
    backend.prepare(absorbed)
    return MLASplit(absorbed, absorbed_rows, decompressed, decompressed_rows, slots)


def _subset(meta: AttentionMetadata, keep: np.ndarray, cu_q: np.ndarray, ctx: np.ndarray, contiguous_keys: bool
            ) -> tuple[AttentionMetadata, torch.Tensor | None]:
    """The metadata of the sequences `keep` selects and their token rows (None: all of them). contiguous_keys: the
    keys will be each context laid out whole (no cache read); else read from the cache as `meta` says."""
    seqs = np.flatnonzero(keep)
    new, lens = np.diff(cu_q)[seqs], ctx[seqs]
    sub_cu_q, sub_cu_k = np.zeros(len(seqs) + 1, np.int64), np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(new, out=sub_cu_q[1:])
    np.cumsum(lens, out=sub_cu_k[1:])
    rows = None
    if not keep.all():
        rows = torch.from_numpy(np.arange(sub_cu_q[-1]) + np.repeat(cu_q[seqs] - sub_cu_q[:-1], new))
    # Built from the host's metadata, then moved: the subset keeps its own host copy (meta.on_host), which backends
    # read (the whole step's would describe other sequences).
    host, as_int32 = meta.on_host, lambda a: torch.from_numpy(a.astype(np.int32))  # noqa: E731
    sub = replace(host, slot_mapping=host.slot_mapping if rows is None or host.slot_mapping is None
                  else host.slot_mapping[rows], block_tables=host.block_tables[torch.from_numpy(seqs)],
                  context_lens=as_int32(lens), cu_seqlens_q=as_int32(sub_cu_q), cu_seqlens_k=as_int32(sub_cu_k),
                  max_seqlen_q=int(new.max()), max_seqlen_k=int(lens.max()),
                  has_cached_prefix=not contiguous_keys and bool((lens > new).any()), backend_state=None,
                  model_state=None)
    if contiguous_keys:  # a single query, the context's last position, sees every key: no decode over the cache
        sub.causal = meta.causal and sub.max_seqlen_q > 1
    device = meta.context_lens.device
    moved = sub.to(device)
    # All rows kept: the step's own slots, on the device already (the host's are a view of a staging buffer that the
    # next step, with async scheduling, may overwrite before a copy queued now runs).
    sub = replace(moved, state_slots=meta.state_slots,
                  slot_mapping=meta.slot_mapping if rows is None else moved.slot_mapping)
    return sub, None if rows is None else rows.to(device, non_blocking=True)


def _context_slots(meta: AttentionMetadata, keep: np.ndarray, ctx: np.ndarray) -> torch.Tensor:
    """The cache slots of the kept sequences' contexts, one after the other (this step's rows are stored already)."""
    seqs = np.flatnonzero(keep)
    lens = ctx[seqs]
    tables = meta.on_host.block_tables[torch.from_numpy(seqs)].numpy().astype(np.int64)
    owner = np.repeat(np.arange(len(seqs)), lens)
    pos = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    slots = tables[owner, pos // meta.block_size] * meta.block_size + pos % meta.block_size
    return torch.from_numpy(slots).to(meta.context_lens.device, non_blocking=True)
