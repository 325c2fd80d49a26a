"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): DeepSeek-V3's model (MLA, its MoE) with DeepSeek sparse attention (DSA):
in every layer a "lightning indexer" scores each query against every visible key, and the query attends only to its
`index_topk` best keys (all of them in a shorter context). The indexer's keys are cached per layer in the KV cache's
blocks beside the latent rows (IndexerKeyCache), so prefix-cache hits, chunked prefill and preemption keep them. The
selection is a mask on the MLA attention, computed on the PyTorch backend only (selector.py refuses the others).
GLM-MoE-DSA (glm_moe_dsa.py) is this with layers that reuse an earlier layer's selection."""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.attention.cpu import attention
from nanoinfer.layers.attention.mla import MLADims, decompress_pays
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.layers.rotary_embedding import get_rope
from nanoinfer.models.deepseek_v2 import DeepseekV2Attention, DeepseekV2DecoderLayer, DeepseekV2Model
from nanoinfer.models.deepseek_v3 import DeepseekV3ForCausalLM, mlp_by_layer_type
from nanoinfer.models.llama import AttentionOptions, keep_in_fp32_


@dataclass(frozen=True)
class DSAOptions(AttentionOptions):
    indexer: bool = True  # False: the layer reuses the selection of the last layer that has an indexer (GLM-MoE-DSA)
    indexer_rope_interleaved: bool = False  # the indexer's rope layout (V3.2: halves; GLM-MoE-DSA: pairs)
    indexer_rope_last: bool = False  # the indexer ropes its last qk_rope_head_dim dims, not its first (HY-V4)
    indexer_norm_eps: float = 1e-6  # its key's LayerNorm's (HY-V4: the config's rms_norm_eps)


@dataclass
class SparseStep:
    """What every sparse layer of a step needs of its sequences, derived once (one host read) and kept on the metadata
    (MiniMax-M3's block-sparse layers use it too: minimax_m3.py)."""
    spans: list[tuple[int, int, int]]  # per sequence: its first row in the step, its rows, its context length
    # Per sequence: the cache slots of its whole context, None where this step's rows are the whole context.
    context_slots: list[torch.Tensor | None]
    decompress: list[bool]  # per sequence: attended over decompressed K/V (else absorbed; see mla.decompress_pays)
    # The last indexer's: per sequence [rows, context] bool (MiniMax-M3's: [KV heads, rows, context]), True: attended.
    selection: list[torch.Tensor] | None = None


def sparse_step(meta: AttentionMetadata, dims: MLADims | None = None) -> SparseStep:
    """The step's SparseStep, made by its first sparse layer and kept on `meta` for the others; dims: MLA's widths,
    which `decompress` weighs (None: no MLA, nothing decompressed)."""
    if meta.model_state is None:
        cu, ctx = meta.on_host.cu_seqlens_q.tolist(), meta.on_host.context_lens.tolist()
        spans = [(cu[i], cu[i + 1] - cu[i], ctx[i]) for i in range(meta.num_seqs)]
        new = np.array([n for _, n, _ in spans])
        decompress = decompress_pays(new, np.array(ctx) - new, dims).tolist() if dims else [False] * len(spans)
        meta.model_state = SparseStep(spans, [None if n == c else meta.context_slots(i, c)
                                              for i, (_, n, c) in enumerate(spans)], decompress)
    return meta.model_state


class IndexerKeyCache(Attention):
    """The indexer's key of every token (one head of index_head_dim, no values), cached in the KV cache's blocks at the
    latent rows' slots: the model runner sizes and allocates it with the attention layers' caches. Any per-token row a
    layer reads back is cached alike (DeepSeek-V4's compressors' projections: deepseek_v4.py)."""

    def __init__(self, head_dim: int):
        super().__init__(1, head_dim, 1.0, 1)

    def cache_values_per_token(self) -> int:
        return self.head_dim

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k_cache = torch.zeros((num_blocks, block_size, 1, self.head_dim), dtype=dtype, device=device)

    def store(self, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata) -> None:
        """k [tokens, 1, head_dim] into the cache (v: None, there are no values)."""
        if meta.slot_mapping is not None and self.k_cache.numel():
            self.backend.store_kvcache(k, None, self.k_cache, None, meta.slot_mapping)

    def keys(self, k: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        """A sequence's keys [context, head_dim]: its rows of this step's k, or its context read back from the cache."""
        return k[:, 0] if slots is None else self.k_cache.view(-1, self.head_dim)[slots]


class Indexer(nn.Module):
    """transformers' DeepseekV32Indexer: per query, score(key) = sum over heads h of w_h * relu(q_h . key * d^-1/2),
    with q from the query's low-rank latent (wq_b), the key a LayerNorm of wk(x) (one per token, shared by the heads),
    rope over their first qk_rope_head_dim dims (HY-V4's: their last), w = weights_proj(x) * heads^-1/2; scores in
    fp32, the keys cached in the model's dtype. Replicated under tensor parallelism (every rank selects alike)."""

    def __init__(self, config: PretrainedConfig, options: DSAOptions):
        super().__init__()
        self.num_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=options.indexer_norm_eps)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads)
        self.rotary_emb = get_rope(config, self.head_dim, config.max_position_embeddings, options.rope_layer_type,
                                   options.indexer_rope_interleaved, config.qk_rope_head_dim)
        # The unrotated dims before the rotated ones: the rope, which turns leading dims, takes the rotated alone.
        self.unrotated_dim = self.head_dim - config.qk_rope_head_dim if options.indexer_rope_last else 0
        self.cache = IndexerKeyCache(self.head_dim)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, q_latent: torch.Tensor, step: SparseStep,
                meta: AttentionMetadata) -> list[torch.Tensor]:
        """Each sequence's selection [rows, context] (True: attended), its causal mask alone where the context holds
        no more than index_topk keys."""
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)
        # In the norm's and weights_proj's dtype, as transformers' indexers cast (fp32 in HY-V4, weights_proj in fp16
        # models: see hy_v4.py and DeepseekV32ForCausalLM).
        k = self.k_norm(self.wk(x).to(self.k_norm.weight.dtype)).to(x.dtype).unsqueeze(1)
        if positions is not None:
            q, k = self.rope(positions, q, k)
        self.cache.store(k, None, meta)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.num_heads ** -0.5
        selection = []
        for (start, n, context), slots in zip(step.spans, step.context_slots):
            keys = self.cache.keys(k[start:start + n], slots).float()
            scores = F.relu(torch.matmul(q[start:start + n].float(), keys.T) * self.head_dim ** -0.5)
            selection.append(self.select(torch.matmul(weights[start:start + n].unsqueeze(1), scores).squeeze(1),
                                         meta.causal))
        return selection

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.unrotated_dim:
            return self.rotary_emb(positions, q, k)
        (q_pass, q_rot), (k_pass, k_rot) = (t.split([self.unrotated_dim, t.shape[-1] - self.unrotated_dim], -1)
                                            for t in (q, k))
        q_rot, k_rot = self.rotary_emb(positions, q_rot.contiguous(), k_rot.contiguous())
        return torch.cat([q_pass, q_rot], -1), torch.cat([k_pass, k_rot], -1)

    def select(self, scores: torch.Tensor, causal: bool) -> torch.Tensor:
        """scores [rows, context] of the context's last rows -> their top index_topk visible keys."""
        n, context = scores.shape
        visible = torch.ones_like(scores, dtype=torch.bool)
        if causal:
            visible = visible.tril(context - n)
        if context <= self.topk:
            return visible
        best = scores.masked_fill(~visible, float("-inf")).topk(self.topk, -1).indices
        return torch.zeros_like(visible).scatter_(-1, best, True) & visible


class DeepseekV32Attention(DeepseekV2Attention):
    """MLA (always with the low-rank q, whose latent the indexer reads) attending, per query, to the keys its layer's
    indexer selects (or, with `indexer` False, the last indexer's; with a sliding window instead, those of its window:
    Dots3's sliding layers). Each sequence attends over its context read back from the latent cache, absorbed or
    decompressed as MLA's split weighs it (mla.decompress_pays), the selection as SDPA's mask."""
    per_step_host_state = True  # sparse_step reads each step's spans on the host: ModelRunner.model_capturable

    def __init__(self, config: PretrainedConfig, options: DSAOptions):
        super().__init__(config, options)
        self.indexer = Indexer(config, options) if options.indexer else None
        self.sliding_window = options.sliding_window

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        o = self.sparse_attention(positions, x, q, q_latent, meta)
        return self.o_proj(o if self.gate_activation is None else self.gate_output(o, x))  # HY-V4's gate

    def sparse_attention(self, positions: torch.Tensor | None, x: torch.Tensor, q: torch.Tensor,
                         q_latent: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [tokens, heads, qk dim] and its latent -> [tokens, heads * v_head_dim], each query over its selection."""
        q_nope, q_rope, k = self.project(positions, q, x)
        self.attn.store(k, None, meta)
        step = sparse_step(meta, self.dims)
        out = q.new_empty(x.shape[0], self.num_heads * self.v_dim)
        for (start, n, _), slots, decompress, mask in zip(step.spans, step.context_slots, step.decompress,
                                                          self.selection(positions, x, q_latent, step, meta)):
            rows = slice(start, start + n)
            latent = k[rows, 0] if slots is None else self.attn.k_cache.view(-1, k.shape[-1])[slots]
            if decompress:
                keys, v = self.decompress(latent)
                out[rows] = sparse_rows(torch.cat([q_nope[rows], q_rope[rows]], -1), keys, v, mask, self.attn.scale,
                                        self.attn.sinks)
            else:
                latent = latent.unsqueeze(1)
                o = sparse_rows(self.absorbed_query(q_nope[rows], q_rope[rows]), latent,
                                latent[..., :self.kv_lora_rank], mask, self.attn.scale, self.attn.sinks)
                out[rows] = self.kv_b_proj.up_project_output(o.view(n, self.num_heads, self.kv_lora_rank))
        return out

    def selection(self, positions: torch.Tensor | None, x: torch.Tensor, q_latent: torch.Tensor, step: SparseStep,
                  meta: AttentionMetadata) -> list[torch.Tensor]:
        """Each sequence's mask [rows, context] (True: attended): its indexer's choice (kept on the step for the
        layers that share it), its sliding window's keys, or the last indexer's choice."""
        if self.indexer is not None:
            step.selection = self.indexer(positions, x, q_latent, step, meta)
        elif self.sliding_window is not None:
            return [window_mask(n, context, self.sliding_window if meta.causal else None, x.device)
                    for _, n, context in step.spans]
        return step.selection


def sparse_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [rows, heads, dim], k, v [keys, KV heads, dim] -> [rows, heads * v dim], each row over its mask's keys (mask
    [rows, keys], or [heads, rows, keys] for each head its own); sinks [heads]: see attention()."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return attention(q, k, v, mask, False, scale, None, sinks)[0].transpose(0, 1).flatten(1)


def window_mask(rows: int, context: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[rows, context] bool: the context's last `rows` queries each see the last `window` positions up to their own
    (None: every key; a non-causal pass)."""
    mask = torch.ones(rows, context, dtype=torch.bool, device=device)
    return mask if window is None else mask.tril(context - rows).triu(context - rows - window + 1)


class DeepseekV32DecoderLayer(DeepseekV2DecoderLayer):
    attention_class = DeepseekV32Attention


class DeepseekV32Model(DeepseekV2Model):
    decoder_layer = DeepseekV32DecoderLayer


def check_dsa_config(config: PretrainedConfig) -> None:
    if not config.q_lora_rank:
        raise ValueError(f"q_lora_rank={config.q_lora_rank!r} in the model config: DeepSeek sparse attention's indexer "
                         f"reads the query's low-rank latent")
    if not 0 < config.qk_rope_head_dim <= config.index_head_dim:
        raise ValueError(f"index_head_dim={config.index_head_dim!r} in the model config: the indexer ropes its first "
                         f"qk_rope_head_dim={config.qk_rope_head_dim} dims")
    if not isinstance(config.index_topk, int) or config.index_topk < 1:
        raise ValueError(f"index_topk={config.index_topk!r} in the model config; expected a positive int")


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    model_class = DeepseekV32Model
    make_mlp = staticmethod(mlp_by_layer_type)

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> DSAOptions:
        return DSAOptions(rope_interleaved=True)  # transformers' V3.2 MLA always interleaves (its config has no field)

    check_config = staticmethod(check_dsa_config)  # what the family cannot run, refused by name
    # transformers' `_keep_in_fp32_modules`: kept in fp32 in fp16 models alone (bf16 ones hold them in bf16); the
    # indexer runs them on its input cast to their dtype.
    fp16_fp32_modules: tuple[str, ...] = ("indexer.weights_proj",)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
        if torch.get_default_dtype() == torch.float16:  # the one the engine builds the model under
            keep_in_fp32_(self, self.fp16_fp32_modules)
