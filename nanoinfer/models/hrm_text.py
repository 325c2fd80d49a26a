"""HRM-Text (`HrmTextForCausalLM`, Sapient's Hierarchical Reasoning Model for text): two stacks of Llama layers
(weightless RMSNorms, multi-head attention gated per element by the sigmoid of its own projection, fused with q, k
and v in the Hub's `gqkv_proj`) run in cycles. Per high-level cycle (`H_cycles`), the low-level stack runs `L_cycles`
times on its state plus the high-level one, then the high-level stack once on its state plus the low-level one; each
run of a stack ends in a weightless norm. The high-level state starts as the embeddings times `embedding_scale`, the
low-level one as the learned `z_L_init`; the last high-level state is the model's output. Every run of a layer
attends over keys and values of its own: each layer keeps one KV cache per run (InvocationAttention). `prefix_lm`'s
bidirectional block over instruction tokens, which transformers applies only where it is given `token_type_ids`, does
not apply: prompts attend causally, as transformers' do without them."""
import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.layernorm import WeightlessRMSNorm
from nanoinfer.layers.linear import RegroupedQKVLinear
from nanoinfer.models.llama import (AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                    MLPFactory, OptionsFactory)


class GatedQKVLinear(RegroupedQKVLinear):
    """The Hub's `gqkv_proj`: the gate's, q's, k's and v's rows, each heads x head_dim, one after the other; loaded as
    Qwen3-Next's gated q (AttentionOptions.output_gate: each head's query rows, then its gate rows), k and v."""

    def parts(self, loaded: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        gate, q, k, v = loaded.chunk(4)
        heads = self.total_num_heads // 2  # the query "heads" hold the gates too
        per_head = (heads, self.head_size, *loaded.shape[1:])
        return [("q", torch.stack([q.reshape(per_head), gate.reshape(per_head)], 1)), ("k", k), ("v", v)]


class HrmTextAttention(LlamaAttention):
    qkv_class = GatedQKVLinear


class HrmTextDecoderLayer(LlamaDecoderLayer):
    attention_class = HrmTextAttention


class InvocationAttention(nn.Module):
    """The KV caches of a layer that runs several times in one forward pass: an Attention per run, the one
    `invocation` (set before each run of the layer's stack) names."""

    def __init__(self, attn: Attention, invocations: int):
        super().__init__()
        self.runs = nn.ModuleList(copy.deepcopy(attn) for _ in range(invocations))
        self.invocation = 0

    @property
    def current(self) -> Attention:
        """The run's Attention, for layers that attend through its cache themselves (Inkling-2-Loop's)."""
        return self.runs[self.invocation]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.current(q, k, v, meta)


class HrmTextStack(nn.Module):
    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory,
                 invocations: int):
        super().__init__()
        self.layers = nn.ModuleList(
            HrmTextDecoderLayer(config, attention_options(config, i), make_mlp(config, i), WeightlessRMSNorm)
            for i in range(config.num_layers_per_stack))
        for layer in self.layers:
            layer.self_attn.attn = InvocationAttention(layer.self_attn.attn, invocations)
        self.final_norm = WeightlessRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, invocation: int, meta: AttentionMetadata
                ) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            layer.self_attn.attn.invocation = invocation
            x, residual = layer(positions, x, residual, meta)
        return self.final_norm(x, residual)[0]


class HrmTextModel(nn.Module):
    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__()
        self.h_cycles, self.l_cycles = config.H_cycles, config.L_cycles
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_scale: float = config.embedding_scale
        self.L_module = HrmTextStack(config, attention_options, make_mlp, self.h_cycles * self.l_cycles)
        self.H_module = HrmTextStack(config, attention_options, make_mlp, self.h_cycles)
        self.z_L_init = nn.Parameter(torch.zeros(config.hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        high = self.embed_tokens(input_ids) * self.embedding_scale
        low = self.z_L_init.expand_as(high)
        for h in range(self.h_cycles):
            for l in range(self.l_cycles):
                low = self.L_module(positions, low + high, h * self.l_cycles + l, meta)
            high = self.H_module(positions, high + low, h, meta)
        return high


class HrmTextForCausalLM(LlamaForCausalLM):
    model_class = HrmTextModel
    weight_name_substitutions = {".attn.gqkv_proj.": ".self_attn.qkv_proj.", ".attn.o_proj.": ".self_attn.o_proj."}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, output_gate=True, num_kv_heads=config.num_attention_heads)
