"""Zamba2 (`Zamba2ForCausalLM`, Zyphra's Zamba2-1.2B / 2.7B / 7B): Mamba2 layers, and hybrid layers that first run
one of `num_mem_blocks` shared transformer blocks (in rotation) on the concatenated hidden states and input embeddings,
each invocation with its own LoRA adapters, KV cache and linear back to the hidden size, whose output joins the
input of the layer's Mamba2 mixer. Zamba (zamba.py) reuses these parts: one shared block, no adapters, no rope."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                     ReplicatedLinear, RowParallelLinear)
from nanoinfer.layers.mamba2 import Mamba2Mixer, Mamba2Settings
from nanoinfer.layers.recurrent import RecurrentBatch
from nanoinfer.layers.rotary_embedding import get_rope
from nanoinfer.models.hybrid import HybridDecoderLayer
from nanoinfer.models.llama import LlamaForCausalLM, LlamaMLP

# transformers' Zamba2RMSNormGated is built with this eps, whatever rms_norm_eps says.
GATED_NORM_EPS = 1e-5


def check_config(config: PretrainedConfig) -> None:
    """The shapes transformers' Zamba2 assumes without checking, and the options it ignores."""
    where = f"in {config.name_or_path or 'the model config'}"
    if 2 * config.hidden_size % config.num_attention_heads:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} must divide the shared attention's width "
                         f"2 x hidden_size={2 * config.hidden_size} {where}")
    if config.use_shared_attention_adapter and config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(f"use_shared_attention_adapter with num_key_value_heads={config.num_key_value_heads} != "
                         f"num_attention_heads={config.num_attention_heads} is not supported {where} (the k and v "
                         f"adapters are as wide as the queries)")
    if getattr(config, "use_shared_mlp_adapter", True) is False:
        raise ValueError(f"use_shared_mlp_adapter=False is not supported {where}: transformers' Zamba2 always applies "
                         f"the shared MLP's adapters")
    if config.n_mamba_heads * config.mamba_headdim != int(config.mamba_expand * config.hidden_size):
        raise ValueError(f"n_mamba_heads={config.n_mamba_heads} must divide mamba_expand x hidden_size="
                         f"{int(config.mamba_expand * config.hidden_size)} {where}")


def mamba2_settings(config: PretrainedConfig) -> Mamba2Settings:
    """Zamba2's names; its conv always has a bias (whatever use_conv_bias says), dt is floored at time_step_min."""
    return Mamba2Settings(config.hidden_size, config.n_mamba_heads, config.mamba_headdim, config.mamba_ngroups,
                          config.mamba_d_state, config.mamba_d_conv, config.chunk_size, GATED_NORM_EPS, True,
                          config.add_bias_linear, config.add_bias_linear, (config.time_step_min, float("inf")))


def mamba_layer(config: PretrainedConfig) -> HybridDecoderLayer:
    """x + mixer(norm(x)): a Mamba2 layer, and the second half of a hybrid one."""
    return HybridDecoderLayer(config, Mamba2Mixer(mamba2_settings(config)), False, None, config.rms_norm_eps)


def adapters(invocations: list[int], input_size: int, rank: int, make_b: type[LinearBase], *b_args) -> nn.ModuleDict:
    """transformers' per-invocation adapters of a shared projection (its `*_adapter_list`, by hybrid-layer index): x
    A^T B^T added to the projection's output; A [rank, input_size] whole on every rank (it is small), B split over
    the ranks as the projection's output is."""
    return nn.ModuleDict({str(i): nn.Sequential(ReplicatedLinear(input_size, rank), make_b(rank, *b_args))
                          for i in invocations})


class Zamba2Attention(nn.Module):
    """The shared attention's weights: q/k/v over the 2 x hidden input, heads of 2 x hidden / num_attention_heads
    scaled by (head_dim / 2) ** -0.5, rope where `use_mem_rope` (Zamba has none), o_proj back to hidden; the adapters
    of each invocation of this block (`invocations`; None: no adapters, as Zamba). The KV cache is the invocation's
    (its hybrid layer's Attention)."""

    def __init__(self, config: PretrainedConfig, invocations: list[int] | None):
        super().__init__()
        heads, width = config.num_attention_heads, 2 * config.hidden_size
        self.head_dim = width // heads
        self.qkv_proj = QKVParallelLinear(width, self.head_dim, heads, config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = (self.head_dim / 2) ** -0.5
        self.o_proj = RowParallelLinear(width, config.hidden_size)
        self.rotary_emb = (get_rope(config, self.head_dim, config.max_position_embeddings)
                           if getattr(config, "use_mem_rope", False) else None)
        self.adapted = invocations is not None and config.use_shared_attention_adapter
        if self.adapted:
            rank = config.adapter_rank
            self.linear_q_adapter_list, self.linear_k_adapter_list, self.linear_v_adapter_list = (
                adapters(invocations, width, rank, ColumnParallelLinear, heads * self.head_dim) for _ in range(3))

    def kv_cache_layer(self) -> Attention:
        """An invocation's own Attention (its KV cache) for these heads."""
        return Attention(self.num_heads, self.head_dim, self.scale, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, invocation: int, attn: Attention,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.adapted:
            key = str(invocation)
            qkv = qkv + torch.cat([adapter[key](x) for adapter in (self.linear_q_adapter_list,
                                                                    self.linear_k_adapter_list,
                                                                    self.linear_v_adapter_list)], -1)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q.view(-1, self.num_heads, self.head_dim),
                                   k.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(attn(q, k, v, meta))


class Zamba2MLP(LlamaMLP):
    """The shared MLP (act(gate) * up over one gate_up_proj), each invocation's adapter added to gate_up_proj
    (`invocations` None: none, and no biases, as Zamba)."""

    def __init__(self, config: PretrainedConfig, invocations: list[int] | None):
        super().__init__(config, bias=invocations is not None and config.add_bias_linear)
        inter = config.intermediate_size
        self.gate_up_proj_adapter_list = None if invocations is None else adapters(
            invocations, config.hidden_size, config.adapter_rank, MergedColumnParallelLinear, [inter, inter])

    def forward(self, x: torch.Tensor, invocation: int) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_up_proj_adapter_list is not None:
            gate_up = gate_up + self.gate_up_proj_adapter_list[str(invocation)](x)
        return self.down_proj(self.act_fn(gate_up))


class Zamba2SharedTransformer(nn.Module):
    """One shared block (transformers' Zamba2AttentionDecoderLayer): mlp(norm(attn(norm([x, embeddings])))), no
    residual adds. Registered in each hybrid layer that invokes it, loaded once (the checkpoint holds it under the
    first; later copies, where a checkpoint has them, are the same parameters)."""

    def __init__(self, config: PretrainedConfig, invocations: list[int] | None):
        super().__init__()
        self.input_layernorm = RMSNorm(2 * config.hidden_size, config.rms_norm_eps)
        self.self_attn = Zamba2Attention(config, invocations)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = Zamba2MLP(config, invocations)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, embeddings: torch.Tensor, invocation: int,
                attn: Attention, meta: AttentionMetadata) -> torch.Tensor:
        x = self.input_layernorm(torch.cat((x, embeddings), -1))
        x = self.self_attn(positions, x, invocation, attn, meta)
        return self.feed_forward(self.pre_ff_layernorm(x), invocation)


class Zamba2HybridLayer(nn.Module):
    """h = the residual stream; t = linear(shared block(h, embeddings)); h + mixer(norm(h + t)). The invocation's own
    parts: its KV cache (`attn`), its `linear` (whole on every rank: its input is the MLP's all-reduced output, and
    it is hidden x hidden), its Mamba layer (`mamba_decoder`)."""

    def __init__(self, config: PretrainedConfig, shared: Zamba2SharedTransformer, invocation: int,
                 mamba_decoder: HybridDecoderLayer):
        super().__init__()
        self.shared_transformer, self.invocation = shared, invocation
        self.attn = shared.self_attn.kv_cache_layer()
        self.linear = ReplicatedLinear(config.hidden_size, config.hidden_size)
        self.mamba_decoder = mamba_decoder

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                embeddings: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else x + residual
        t = self.linear(self.shared_transformer(positions, h, embeddings, self.invocation, self.attn, meta))
        y, _ = self.mamba_decoder(positions, t, h, meta, batch)  # its norm sees h + t; the residual stream stays h
        return y, h


class Zamba2Model(nn.Module):
    adapted = True  # the shared blocks' per-invocation adapters (Zamba has none)
    check_config = staticmethod(check_config)
    mamba_layer = staticmethod(mamba_layer)

    @staticmethod
    def layout(config: PretrainedConfig) -> tuple[list[int], int]:
        """The hybrid layers' indices and the number of shared blocks they invoke in rotation."""
        return config.hybrid_layer_ids, config.num_mem_blocks

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.check_config(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Hybrid layer n (in layer order) invokes shared block n % num_mem_blocks, as transformers ties them.
        hybrid, blocks = self.layout(config)
        shared = [Zamba2SharedTransformer(config, list(range(b, len(hybrid), blocks)) if self.adapted else None)
                  for b in range(min(blocks, len(hybrid)))]
        self.layers = nn.ModuleList(
            Zamba2HybridLayer(config, shared[hybrid.index(i) % blocks], hybrid.index(i), self.mamba_layer(config))
            if i in hybrid else self.mamba_layer(config) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        batch = RecurrentBatch.from_metadata(meta)
        embeddings = self.embed_tokens(input_ids)
        x, residual = embeddings, None
        for layer in self.layers:
            if isinstance(layer, Zamba2HybridLayer):
                x, residual = layer(positions, x, residual, embeddings, meta, batch)
            else:
                x, residual = layer(positions, x, residual, meta, batch)
        x, _ = self.final_layernorm(x, residual)
        return x


class Zamba2ForCausalLM(nn.Module):
    model_class: type[Zamba2Model] = Zamba2Model
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    weight_name_substitutions = {".mamba.": ".mixer."}  # HybridDecoderLayer's name for the recurrent mixer

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.model = self.model_class(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    forward = LlamaForCausalLM.forward
    compute_logits = LlamaForCausalLM.compute_logits
