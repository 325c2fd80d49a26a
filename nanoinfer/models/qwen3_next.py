"""Qwen3-Next: Gated DeltaNet (linear attention with per-sequence recurrent state) and gated full-attention layers,
zero-centred RMSNorms (1 + weight, applied in fp32 as Gemma's), partial rotary embedding; MLPs are routed experts plus
a gated shared expert, or dense."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.gated_delta_rule import GatedDeltaRule
from nanoinfer.layers.layernorm import GatedRMSNorm, GemmaRMSNorm
from nanoinfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from nanoinfer.layers.recurrent import RecurrentBatch, RowShardedWeight, load_rank_rows
from nanoinfer.models.hybrid import HybridDecoderLayer
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP, MLPFactory
from nanoinfer.models.qwen2_moe import Qwen2MoeSparseMoeBlock, is_sparse_layer
from nanoinfer.utils.dist import tp_size


class Qwen3NextGatedDeltaNet(nn.Module):
    """Linear attention. Under tensor parallelism each rank holds a contiguous run of key heads and the value heads
    they serve (as vLLM's Qwen3NextGatedDeltaNet): their rows of the input projections, their q | k | v conv
    channels, A_log, dt_bias and state, and out_proj's input columns (one all-reduce). The gated norm is per head,
    so it needs no other rank. num_k_heads and num_v_heads are this rank's."""
    # beta = max_beta * sigmoid(b); OLMo Hybrid's allow_neg_eigval doubles it (eigenvalues 1 - beta down to -1).
    max_beta = 1.0

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        num_k_heads, num_v_heads, tp = config.linear_num_key_heads, config.linear_num_value_heads, tp_size()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        if num_k_heads % tp:
            raise ValueError(f"linear_num_key_heads={num_k_heads} does not split over tensor_parallel_size={tp}")
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        self.num_k_heads, self.num_v_heads = num_k_heads // tp, num_v_heads // tp
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_dim, value_dim = num_k_heads * self.head_k_dim, num_v_heads * self.head_v_dim  # all ranks'
        kernel = config.linear_conv_kernel_dim
        self.init_projections(config.hidden_size, key_dim, value_dim, num_v_heads)
        # A weight holder: the conv runs in GatedDeltaRule.
        self.conv1d = RowShardedWeight([(key_dim, True), (key_dim, True), (value_dim, True)], (1, kernel), bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, config.hidden_size)
        self.delta_rule = GatedDeltaRule(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, kernel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A_log and dt_bias: this rank's value heads."""
        load_rank_rows(param, loaded)

    def init_projections(self, hidden_size: int, key_dim: int, value_dim: int, num_v_heads: int) -> None:
        # Rows grouped by key head: [q, k, v, z] and [b, a] of the value heads each key head serves, so a rank's
        # share of the rows is its key heads' groups.
        self.in_proj_qkvz = ColumnParallelLinear(hidden_size, 2 * key_dim + 2 * value_dim)
        self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * num_v_heads)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> the conv's input [tokens, q | k | v] (this rank's heads of each, in head order), the
        output gate z [tokens, v_heads, v_dim], b and a [tokens, v_heads]."""
        n, group = x.shape[0], self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(n, self.num_k_heads, -1)
        value_width = group * self.head_v_dim
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, value_width, value_width], -1)
        b, a = self.in_proj_ba(x).view(n, self.num_k_heads, 2 * group).split([group, group], -1)
        mixed_qkv = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), -1)
        return (mixed_qkv, z.reshape(n, self.num_v_heads, self.head_v_dim), b.reshape(n, self.num_v_heads),
                a.reshape(n, self.num_v_heads))

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        mixed_qkv, z, b, a = self.project(x)
        beta = b.sigmoid().float() * self.max_beta  # the sigmoid in the model's dtype, as transformers takes it
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = self.delta_rule(mixed_qkv, self.conv1d.weight.squeeze(1), g, beta, batch).to(x.dtype)
        return self.out_proj(self.norm(out, z).flatten(1))


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    linear_attention_class: type[Qwen3NextGatedDeltaNet] = Qwen3NextGatedDeltaNet

    def __init__(self, config: PretrainedConfig, layer_idx: int, mlp: nn.Module):
        layer_type = config.layer_types[layer_idx]
        if layer_type == "linear_attention":
            mixer = self.linear_attention_class(config)
        elif layer_type == "full_attention":
            options = AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True,
                                       output_gate=True, qk_norm_class=GemmaRMSNorm, rope_in_dtype=True)
            mixer = LlamaAttention(config, options)
        else:
            raise ValueError(f"unsupported layer type {layer_type!r} in layer {layer_idx}")
        super().__init__(config, mixer, layer_type == "full_attention", mlp, config.rms_norm_eps, norm=GemmaRMSNorm)


class Qwen3NextModel(nn.Module):
    decoder_layer: type[Qwen3NextDecoderLayer] = Qwen3NextDecoderLayer

    def __init__(self, config: PretrainedConfig, make_mlp: MLPFactory):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config, i, make_mlp(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        batch = RecurrentBatch.from_metadata(meta)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, batch)
        x, _ = self.norm(x, residual)
        return x


class Qwen3NextForCausalLM(nn.Module):
    model_class: type[Qwen3NextModel] = Qwen3NextModel
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    # Multi-token-prediction weights some checkpoints carry: not used for plain decoding.
    ignored_weight_prefixes = ("mtp.",)
    weight_name_substitutions = {".linear_attn.": ".mixer."}  # HybridDecoderLayer's name for the recurrent mixer

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return Qwen2MoeSparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else LlamaMLP(config)

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.model = self.model_class(config, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    forward = LlamaForCausalLM.forward
    compute_logits = LlamaForCausalLM.compute_logits
