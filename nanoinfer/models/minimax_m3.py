"""MiniMax-M3's text model (`MiniMaxM3VLForCausalLM`; the language model of `MiniMaxM3SparseForConditionalGeneration`):
GQA attention with per-head Gemma q/k norms ((1 + w)) and rope over `partial_rotary_factor` of each head. The layers
`layer_types` marks "minimax_m3_sparse" attend block-sparsely: a lightning indexer with one head per KV head scores
every visible key for each query (q . k of Gemma-normed, roped projections; no scale, weights or relu), the scores are
max-pooled over blocks of `index_block_size` positions (counted from position 0), and the query heads of each KV group
attend only to their head's `index_topk_blocks` best blocks, the query's own block and the `index_local_blocks` - 1
before it always among them. As with DeepSeek sparse attention (deepseek_v32.py, whose SparseStep and IndexerKeyCache
this uses), the indexer's keys are cached per layer in the KV blocks, and each sequence attends over its context read
back from the cache with the selection as SDPA's mask, on the PyTorch backend only. MLPs dense or MoE by
`mlp_layer_types`, all with GPT-OSS's clamped SwiGLU (gate rows, then up rows); the MoE routes as MiniMax-M2's (sigmoid
+ correction bias, renormalized), times `routed_scaling_factor`, plus a shared expert. Gemma RMSNorms throughout."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.fused_moe import FusedMoE, GatedActivation, clamped_swiglu, select_experts_sigmoid_biased
from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from nanoinfer.layers.rotary_embedding import get_rope, rope_parameters
from nanoinfer.models.config_checks import check_each_in, config_source
from nanoinfer.models.deepseek_v2 import DeepseekRouter
from nanoinfer.models.deepseek_v32 import DSAOptions, IndexerKeyCache, SparseStep, sparse_rows, sparse_step
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from nanoinfer.models.mixtral import MixtralForCausalLM
from nanoinfer.utils.dist import tp_rank, tp_size

_LAYER_TYPES = ("full_attention", "minimax_m3_sparse")


def rotary_dim(config: PretrainedConfig) -> int:
    """The rotated leading dims of each head, as transformers' rope derives them (its `rotary_dim` field is unused)."""
    return int(config.head_dim * rope_parameters(config).get("partial_rotary_factor", 1.0))


class BlockIndexer(nn.Module):
    """transformers' MiniMaxM3VLIndexer (its q_proj/k_proj here wq/wk, apart from the attention's packed names);
    replicated under tensor parallelism (each rank takes its KV heads' selections)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.block_size, self.topk, self.local = (config.index_block_size, config.index_topk_blocks,
                                                  config.index_local_blocks)
        self.wq = ReplicatedLinear(config.hidden_size, self.num_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.q_norm, self.k_norm = (GemmaRMSNorm(self.head_dim, config.rms_norm_eps) for _ in range(2))
        # The attention's rope tables, over the indexer's leading dims.
        self.rotary_emb = get_rope(config, self.head_dim, config.max_position_embeddings, rotary_dim=rotary_dim(config))
        self.cache = IndexerKeyCache(self.head_dim)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, step: SparseStep, meta: AttentionMetadata
                ) -> list[torch.Tensor]:
        """Each sequence's selection [index heads, rows, context] (True: attended)."""
        q = self.q_norm(self.wq(x).view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(self.wk(x).view(-1, 1, self.head_dim))
        if positions is not None:
            q, k = self.rotary_emb(positions, q, k)
        self.cache.store(k, None, meta)
        return [self.select(torch.matmul(q[start:start + n].float().transpose(0, 1),
                                         self.cache.keys(k[start:start + n], slots).float().T), meta.causal)
                for (start, n, _), slots in zip(step.spans, step.context_slots)]

    def select(self, scores: torch.Tensor, causal: bool) -> torch.Tensor:
        """scores [heads, rows, context] of the context's last rows -> per head the keys of their chosen blocks."""
        heads, n, context = scores.shape
        visible = torch.ones(n, context, dtype=torch.bool, device=scores.device)
        if causal:
            visible = visible.tril(context - n)
        blocks = -(-context // self.block_size)
        pooled = F.pad(scores.masked_fill(~visible, float("-inf")), (0, blocks * self.block_size - context),
                       value=float("-inf")).view(heads, n, blocks, self.block_size).amax(-1)
        own = torch.arange(context - n, context, device=scores.device) // self.block_size
        local = (own[:, None] - torch.arange(self.local, device=scores.device)).clamp(min=0)
        pooled.scatter_(-1, local.expand(heads, -1, -1), float("inf"))
        chosen = pooled.topk(min(self.topk, blocks), -1).indices
        # A chosen block with no visible key (transformers' -1) adds none: `visible` drops its keys.
        keep = torch.zeros_like(pooled, dtype=torch.bool).scatter_(-1, chosen, True)
        return keep.repeat_interleave(self.block_size, -1)[..., :context] & visible


class BlockSparseAttention(Attention):
    """Attention of each sequence over its context (this step's K/V, or its cache slots) with the layer's indexer
    selection as the mask: this rank's KV heads' selections, each serving its group of query heads."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, total_kv_heads: int):
        super().__init__(num_heads, head_dim, scale, num_kv_heads)
        self.first_kv_head = tp_rank() * total_kv_heads // tp_size()  # as QKVParallelLinear shards them

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata
               ) -> torch.Tensor:
        step = sparse_step(meta)
        q = q.view(-1, self.num_heads, self.head_dim)
        k, v = (t.view(-1, self.num_kv_heads, self.head_dim) for t in (k, v))
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for (start, n, _), slots, mask in zip(step.spans, step.context_slots, step.selection):
            rows = slice(start, start + n)
            keys, values = (k[rows], v[rows]) if slots is None else (
                cache.view(-1, self.num_kv_heads, self.head_dim)[slots] for cache in (self.k_cache, self.v_cache))
            mask = mask.narrow(0, self.first_kv_head, self.num_kv_heads)
            out[rows] = sparse_rows(q[rows], keys, values, mask.repeat_interleave(self.num_heads // self.num_kv_heads,
                                                                                  0), self.scale)
        return out


class MiniMaxM3Attention(LlamaAttention):
    """indexer_class: the module that selects, per KV head, the keys each query attends to (Qwen4-Exp's QSA)."""
    indexer_class: type[nn.Module] = BlockIndexer

    def __init__(self, config: PretrainedConfig, options: DSAOptions):
        super().__init__(config, options)
        self.indexer = self.indexer_class(config) if options.indexer else None
        self.per_step_host_state = self.indexer is not None  # sparse_step: see ModelRunner.model_capturable
        if self.indexer is not None:
            self.attn = BlockSparseAttention(self.num_heads, self.head_dim, self.attn.scale, self.num_kv_heads,
                                             config.num_key_value_heads)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.indexer is not None:  # read by this layer's attention
            step = sparse_step(meta)
            step.selection = self.indexer(positions, x, step, meta)
        return super().forward(positions, x, meta)


class MiniMaxM3MLP(nn.Module):
    """A dense MLP or the MoE's shared expert: GPT-OSS's clamped SwiGLU over gate_up_proj's gate rows, then up rows
    (or `activation`'s: DeepSeek-V4's shared expert clamps a plain SwiGLU)."""

    def __init__(self, config: PretrainedConfig, intermediate_size: int, activation: GatedActivation | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size)
        self.act_fn = activation or clamped_swiglu(config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(*self.gate_up_proj(x).chunk(2, -1)))


class MiniMaxM3MoE(nn.Module):
    """A replicated router (`gate`, with its correction bias) in front of the experts (FusedMoE: each rank a
    slice of every expert), and the shared expert."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        num_experts, self.top_k, self.scaling = (config.num_local_experts, config.num_experts_per_tok,
                                                 config.routed_scaling_factor)
        # transformers' router: logits in the model's dtype, upcast, the bias in the model's dtype.
        self.gate = DeepseekRouter(config, correction_bias=True, num_experts=num_experts, in_model_dtype=True)
        # renormalize=False: FusedMoE.forward's softmax routing is not used, forward routes instead.
        self.experts = FusedMoE(num_experts, self.top_k, config.hidden_size, config.intermediate_size,
                                renormalize=False, activation=clamped_swiglu(config.swiglu_alpha, config.swiglu_limit))
        self.shared_experts = MiniMaxM3MLP(config, config.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_sigmoid_biased(self.gate(x), self.top_k, self.gate.e_score_correction_bias, 1,
                                                     1, renormalize=True, scaling=self.scaling)
        return self.experts.run_experts(x, weights, ids) + self.shared_experts(x)


class MiniMaxM3DecoderLayer(LlamaDecoderLayer):
    attention_class = MiniMaxM3Attention

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp, GemmaRMSNorm)


class MiniMaxM3Model(LlamaModel):
    decoder_layer = MiniMaxM3DecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot run, refused by name rather than run differently from transformers."""
    where = config_source(config)
    check_each_in(config, "layer_types", _LAYER_TYPES)
    if "minimax_m3_sparse" not in config.layer_types:
        return
    if config.index_n_heads != config.num_key_value_heads:  # transformers gives each KV group one indexer head
        raise ValueError(f"index_n_heads={config.index_n_heads} in {where} must equal num_key_value_heads="
                         f"{config.num_key_value_heads}")
    if config.index_head_dim < rotary_dim(config):  # transformers' rope tables would be cut short
        raise ValueError(f"index_head_dim={config.index_head_dim} in {where} is narrower than the rope's "
                         f"{rotary_dim(config)} dims")
    if not 0 <= config.index_local_blocks <= config.index_topk_blocks:
        raise ValueError(f"index_local_blocks={config.index_local_blocks} in {where} must be between 0 and "
                         f"index_topk_blocks={config.index_topk_blocks}")


class MiniMaxM3VLForCausalLM(LlamaForCausalLM):
    model_class = MiniMaxM3Model
    # transformers' names, and the Hub's (Mixtral's MoE names, the indexer's projections beside the attention's).
    weight_name_substitutions = {**MixtralForCausalLM.weight_name_substitutions,
                                 ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
                                 ".indexer.q_proj.": ".indexer.wq.", ".indexer.k_proj.": ".indexer.wk.",
                                 ".self_attn.index_q_proj.": ".self_attn.indexer.wq.",
                                 ".self_attn.index_k_proj.": ".self_attn.indexer.wk.",
                                 ".self_attn.index_q_norm.": ".self_attn.indexer.q_norm.",
                                 ".self_attn.index_k_norm.": ".self_attn.indexer.k_norm."}
    ignored_weight_prefixes = ("model.mtp.", "mtp.")  # transformers skips the multi-token-prediction weights

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> DSAOptions:
        return DSAOptions(qk_norm=True, qk_norm_class=GemmaRMSNorm,
                          indexer=config.layer_types[layer_idx] == "minimax_m3_sparse")

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if config.mlp_layer_types[layer_idx] == "sparse":
            return MiniMaxM3MoE(config)
        return MiniMaxM3MLP(config, config.dense_intermediate_size)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
