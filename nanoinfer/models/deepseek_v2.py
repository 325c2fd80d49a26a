"""DeepSeek-V2: multi-head latent attention (MLA: low-rank q and kv projections, a rope key shared by the heads) and
DeepSeek MoE (dense first layers, then softmax-routed experts plus always-on shared experts). DeepSeek-V3
(deepseek_v3.py) is this with its sigmoid, bias-corrected routing."""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.attention.mla import MLADims, MLASplit, mla_split
from nanoinfer.layers.fused_moe import (FusedMoE, Fp32Router, GatedActivation, select_experts_softmax_grouped,
                                        silu_and_mul)
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from nanoinfer.layers.rotary_embedding import get_rope, rope_parameters
from nanoinfer.models.llama import (AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                   LlamaModel, scale_query)
from nanoinfer.utils.dist import tp_size

_TOPK_METHODS = ("greedy", "group_limited_greedy")


def check_attention_config(config: PretrainedConfig) -> None:
    """What the MLA layer needs of the config, refused by name rather than run differently from transformers."""
    if config.num_key_value_heads != config.num_attention_heads:  # transformers' MLA fails on it as well
        raise ValueError(f"num_key_value_heads={config.num_key_value_heads} must equal num_attention_heads="
                         f"{config.num_attention_heads}: MLA derives a key and a value for every head")
    if config.num_attention_heads % tp_size():
        raise ValueError(f"tensor_parallel_size={tp_size()} does not divide the model's num_attention_heads "
                         f"({config.num_attention_heads})")


def check_moe_config(config: PretrainedConfig, grouped: bool, width_field: str = "moe_intermediate_size") -> None:
    """grouped: whether the routing limits each token to its `topk_group` best of `n_group` expert groups;
    width_field: the config's name of an expert's intermediate size."""
    width = getattr(config, width_field)
    if width % tp_size():
        raise ValueError(f"tensor_parallel_size={tp_size()} does not divide the model's {width_field} ({width})")
    if not grouped:
        return
    n_group, topk_group = config.n_group, config.topk_group
    if not isinstance(n_group, int) or n_group < 1 or config.n_routed_experts % n_group:
        raise ValueError(f"n_group={n_group!r} must be a positive int dividing n_routed_experts="
                         f"{config.n_routed_experts}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group!r} must be an int between 1 and n_group={n_group}")


def softmax_scale(config: PretrainedConfig) -> float:
    """1/sqrt(qk head dim), times yarn's mscale squared where the rope is scaled with `mscale_all_dim`, as
    transformers (and DeepSeek's own code) scale the scores."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    factor, mscale_all_dim = params.get("factor", 1.0), params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAUpProjection(ColumnParallelLinear):
    """kv_b_proj, loaded as the checkpoint holds it (each rank its heads' rows). Absorbed (decode), its two halves
    per head: W_UK [heads, qk_nope, kv_lora_rank] takes q_nope into the latent space (the keys' up-projection
    absorbed into the query) and W_UV [heads, kv_lora_rank, v_head_dim] takes each head's attention output over the
    latents up to its value space: one batched matmul each, over the heads. Decompressed (prefill), the linear
    itself: latents -> each head's k_nope and value."""

    def __init__(self, kv_lora_rank: int, num_heads: int, nope_dim: int, v_dim: int):
        super().__init__(kv_lora_rank, num_heads * (nope_dim + v_dim))
        self.nope_dim, self.v_dim = nope_dim, v_dim
        self.w_uk = self.w_uv = torch.empty(0)

    def process_weights_after_loading(self, batch_size_hint: int) -> None:
        w = self.weight.view(-1, self.nope_dim + self.v_dim, self.weight.shape[1])
        self.w_uk = w[:, :self.nope_dim]  # a view: bmm reads each head's [qk_nope, kv_lora_rank] rows in place
        self.w_uv = w[:, self.nope_dim:].transpose(1, 2).contiguous()

    def decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [keys, kv_lora_rank] -> k_nope [keys, heads, qk_nope], v [keys, heads, v_head_dim]."""
        kv = F.linear(latent, self.weight).view(latent.shape[0], -1, self.nope_dim + self.v_dim)
        return kv.split([self.nope_dim, self.v_dim], -1)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [tokens, heads, qk_nope] -> [tokens, heads, kv_lora_rank]: q_nope . (W_UK c) = (q_nope W_UK) . c."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def up_project_output(self, o: torch.Tensor) -> torch.Tensor:
        """o [tokens, heads, kv_lora_rank] (softmax-weighted latents) -> [tokens, heads * v_head_dim]."""
        return torch.bmm(o.transpose(0, 1), self.w_uv).transpose(0, 1).flatten(1)


class DeepseekV2Attention(nn.Module):
    """MLA with vLLM's latent KV cache: per token and layer the cache holds only the normalized latent c_kv
    (kv_lora_rank) and the roped key k_pe (qk_rope_head_dim), as ONE KV head that every query head reads (MQA).
    A step splits its sequences as vLLM does (layers/attention/mla.py). Decodes (and short chunks over long cached
    contexts) attend absorbed: with kv_b_proj's halves absorbed (MLAUpProjection), head h's score is
    q_nope . (W_UK[h] c) + q_pe . k_pe = [q_nope W_UK[h], q_pe] . [c, k_pe], its value W_UV[h] c: attention over the
    cached rows with the latent (each row's first kv_lora_rank entries) as the value, then W_UV per head; one
    576-wide row read per key serves every head, which is what memory-bound decode wants. Prefill attends over
    decompressed K/V: kv_b_proj(c) gives each key its per-head k_nope and value, the key is [k_nope, k_pe], head dims
    192/128 against 576/512 (DeepSeek-V3), ~3x fewer FLOPs where prefill is compute-bound; a cached prefix (prefix
    hit, earlier chunks) is read back from the latent cache and decompressed with the new tokens. q_b_proj (or
    q_proj), kv_b_proj are column-parallel over heads, o_proj row-parallel; the latent projections, their norms and
    so the cache are replicated."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__()
        check_attention_config(config)
        hidden, bias = config.hidden_size, config.attention_bias
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, qk_dim = config.kv_lora_rank, config.qk_nope_head_dim + config.qk_rope_head_dim
        heads = config.num_attention_heads
        self.num_heads = heads // tp_size()
        if getattr(config, "q_lora_rank", None) is None:  # Ling's (bailing_hybrid.py) config has no such field
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)  # transformers' default: the config's is unused
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, config.kv_lora_rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, 1e-6)
        self.kv_b_proj = MLAUpProjection(config.kv_lora_rank, heads, self.nope_dim, self.v_dim)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias)
        self.gate_activation, self.gate_per_head = options.gate_activation, options.gate_per_head
        self.gate_bias = None  # no family's MLA gate has a bias
        if self.gate_activation is not None:  # Ling's output gate (see AttentionOptions), column-parallel as q
            self.g_proj = ColumnParallelLinear(hidden, heads * (1 if self.gate_per_head else self.v_dim))
        # Kimi Linear's MLA (options.rope False) keeps the shared key part, unrotated, and the plain scale.
        # Dots3's rope settings are by layer type, their partial_rotary_factor (Mistral 4's too) that of its head_dim:
        # options.rotary_dim.
        self.rotary_emb = get_rope(config, self.rope_dim, config.max_position_embeddings, options.rope_layer_type,
                                   options.rope_interleaved, options.rotary_dim) if options.rope else None
        scale = softmax_scale(config) if options.rope else qk_dim ** -0.5
        self.query_scale = options.query_scale  # Mistral 4's, after rope: the same factor on q_nope and q_pe
        # The scale of the decompressed scores, which the absorbed ones equal; sinks (HY-V4's), per head as the
        # queries, join the scores alike absorbed or not.
        self.attn = Attention(self.num_heads, self.kv_lora_rank + self.rope_dim, scale, 1,
                              value_prefix_dim=self.kv_lora_rank, sinks=options.sinks)
        self.dims = MLADims(self.num_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_nope, q_rope, k = self.project(positions, self.query(x), x)
        self.attn.store(k, None, meta)
        o = self.attend(q_nope, q_rope, k, meta)
        return self.o_proj(o if self.gate_activation is None else self.gate_output(o, x))

    gate_output = LlamaAttention.gate_output

    def project(self, positions: torch.Tensor | None, q: torch.Tensor, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [tokens, heads, qk dim] and the layer's input -> q_nope, roped q_pe (both scaled by position where
        options.query_scale says), and the latent rows to cache ([tokens, 1, kv_lora_rank + rope dim]: the normalized
        c_kv and the roped k_pe)."""
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        k_rope = self.rope_key(k_rope.unsqueeze(1))
        if positions is not None and self.rotary_emb is not None:  # None: an encoder pass (see LLM.embed)
            q_rope, k_rope = self.rotary_emb(positions, q_rope, k_rope)
        if positions is not None and self.query_scale is not None:
            scale = self.query_scale(positions)
            q_nope, q_rope = scale_query(q_nope, scale), scale_query(q_rope, scale)
        return q_nope, q_rope, torch.cat([self.normalize_latent(latent).unsqueeze(1), k_rope], -1)

    def rope_key(self, k_rope: torch.Tensor) -> torch.Tensor:
        """The shared rope key [tokens, 1, rope dim] before its rotation (Dots3 normalizes it)."""
        return k_rope

    def normalize_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """The latent as cached and up-projected: kv_a_layernorm's output (LongCat-Flash scales it)."""
        return self.kv_a_layernorm(latent)

    def attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata
               ) -> torch.Tensor:
        """Attention over the latent cache (this step's rows stored already), split as mla_split says
        -> [tokens, heads * v_head_dim]."""
        if meta.is_decode:  # the CUDA graphs' path: no split, no host read
            return self.absorbed(q_nope, q_rope, k, meta)
        split = mla_split(meta, self.dims, k.element_size(), self.attn.backend)
        if split.decompressed is None:
            return self.absorbed(q_nope, q_rope, k, meta)
        o = self.decompressed(q_nope, q_rope, k, split)
        if split.absorbed is not None:
            rows = split.absorbed_rows
            absorbed = self.absorbed(q_nope[rows], q_rope[rows], k[rows], split.absorbed)
            o = o.new_empty(q_nope.shape[0], o.shape[1]).index_copy_(0, split.decompressed_rows, o).index_copy_(
                0, rows, absorbed)
        return o

    def absorbed_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, kv_lora_rank + rope dim]: q_nope taken into the latent space, then q_pe."""
        return torch.cat([self.kv_b_proj.absorb_query(q_nope), q_rope], -1)

    def decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [keys, kv_lora_rank + rope dim] -> per-head keys [keys, heads, qk_nope + rope dim] ([k_nope,
        k_pe], the rope key shared by the heads) and values [keys, heads, v_head_dim]."""
        k_nope, v = self.kv_b_proj.decompress(latent[:, :self.kv_lora_rank])
        k_pe = latent[:, None, self.kv_lora_rank:].expand(-1, self.num_heads, -1)
        return torch.cat([k_nope, k_pe], -1), v

    def absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata
                 ) -> torch.Tensor:
        """Attention over the latent cache, queries absorbed into the latent space -> [tokens, heads * v_head_dim]."""
        o = self.attn.attend(self.absorbed_query(q_nope, q_rope), k, None, meta)
        return self.kv_b_proj.up_project_output(o.view(-1, self.num_heads, self.kv_lora_rank))

    def decompressed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, k: torch.Tensor, split: MLASplit
                     ) -> torch.Tensor:
        """Attention of the split's decompressed sequences over their contexts' per-head K/V, decompressed from the
        latent rows (this step's, or the cache's) -> [their tokens, heads * v_head_dim]. Both backends take a value
        narrower than the key as is: the CPU's SDPA, and on CUDA the Triton prefill kernel (values of any width up
        to the keys', non-paged K/V per cu_seqlens_k, bottom-right causal), which also needs no host sync and no
        per-length plans (cuDNN's SDPA); flash-attn 2 wants equal widths (and never runs MLA here)."""
        rows = split.decompressed_rows
        if rows is not None:
            q_nope, q_rope, k = q_nope[rows], q_rope[rows], k[rows]
        latent = k[:, 0] if split.context_slots is None else self.attn.k_cache.view(-1, k.shape[-1])[
            split.context_slots]
        keys, v = self.decompress(latent)
        return self.attn.backend.forward(torch.cat([q_nope, q_rope], -1), keys, v, self.attn.k_cache,
                                         self.attn.v_cache, split.decompressed, self.attn.scale)


class DeepseekRouter(Fp32Router):
    """The router's weight (and V3's e_score_correction_bias, kept in fp32 in 16-bit models as transformers keeps it),
    scoring in fp32 as transformers does; or (in_model_dtype: AFMoE's and Laguna's, which transformers keeps in no
    wider dtype) the logits computed in the model's dtype, then upcast, and the correction bias in the model's dtype."""

    def __init__(self, config: PretrainedConfig, correction_bias: bool, num_experts: int | None = None,
                 fp32_weight: bool = False, in_model_dtype: bool = False):
        """num_experts: where the config does not name it `n_routed_experts`. fp32_weight: see Fp32Router."""
        num_experts = num_experts or config.n_routed_experts
        super().__init__(config.hidden_size, num_experts, fp32_weight)
        self.in_model_dtype = in_model_dtype
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=None if in_model_dtype else torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight).float() if self.in_model_dtype else super().forward(x)


class DeepseekV2MoE(nn.Module):
    """Routed experts (FusedMoE, each rank a slice of every expert) plus `n_shared_experts` shared experts as one
    MLP of n_shared_experts x moe_intermediate_size that every token passes through, added ungated."""
    correction_bias = False
    # The checkpoint's router weight kept as it is (an fp32 one in fp32 in 16-bit models), as transformers 5.25 keeps
    # it for DeepSeek's router and the families that took it (5.23 rounded it; the logits, fp32 in both, equal for a
    # bf16 checkpoint): see Fp32Router.
    fp32_router_weight = True
    router_in_model_dtype = False  # see DeepseekRouter

    def __init__(self, config: PretrainedConfig, num_experts: int | None = None,
                 shared_intermediate_size: int | None = None, activation: GatedActivation = silu_and_mul):
        """num_experts, shared_intermediate_size (0: no shared experts): where the config does not say them as
        DeepSeek's does (`n_routed_experts`; `n_shared_experts` x `moe_intermediate_size`); activation: the routed
        experts' (HY-V4's clamps), the shared experts' stays SiLU."""
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        num_experts = num_experts or config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.gate = DeepseekRouter(config, self.correction_bias, num_experts, self.fp32_router_weight,
                                   self.router_in_model_dtype)
        self.configure_routing(config)
        # renormalize=False: FusedMoE.forward's softmax routing is not used, select_experts routes instead.
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=False, activation=activation)
        if shared_intermediate_size is None:
            shared_intermediate_size = config.moe_intermediate_size * (config.n_shared_experts or 0)
        self.shared_experts = LlamaMLP(config, shared_intermediate_size) if shared_intermediate_size else None

    def configure_routing(self, config: PretrainedConfig) -> None:
        if config.topk_method not in _TOPK_METHODS:
            raise ValueError(f"topk_method={config.topk_method!r} in the model config; expected one of {_TOPK_METHODS}")
        grouped = config.topk_method == "group_limited_greedy"
        check_moe_config(config, grouped)
        # transformers' V2 router ignores norm_topk_prob (False in DeepSeek-V2's configs): so does this one.
        self.num_groups = config.n_group if grouped else None
        self.topk_group, self.scaling = config.topk_group, config.routed_scaling_factor

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts_softmax_grouped(self.gate(x), self.top_k, self.num_groups, self.topk_group,
                                              self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts.run_experts(x, *self.select_experts(x))
        return y if self.shared_experts is None else y + self.shared_experts(x)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_class = DeepseekV2Attention


class DeepseekV2Model(LlamaModel):
    decoder_layer = DeepseekV2DecoderLayer


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_class = DeepseekV2Model
    moe_class: type[DeepseekV2MoE] = DeepseekV2MoE
    # Only the MLPs' gate/up fuse: MLA's q_proj is a projection of its own.
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(rope_interleaved=True)  # V2 rotates (x0, x1), (x2, x3), ... as complex numbers

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config) if layer_idx < config.first_k_dense_replace else cls.moe_class(config)
