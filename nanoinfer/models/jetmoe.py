"""JetMoE: a Llama-style decoder whose attention and MLP are both mixtures of experts, routed alike (each token's top
k of `num_local_experts` router logits, softmaxed among themselves). The mixture of attention heads (MoA): one key
and value projection (`kv_proj`: `num_key_value_heads` heads of `kv_channels`) shared by every expert; each chosen
expert projects the token's queries for all those heads, attention runs with k x that many query heads (the i-th
expert's query head h on KV head h), and each expert's own output projection takes its heads back to the hidden size,
weighted by its routing weight; a bias over the sum. The MoE MLP: GraniteMoE's stacked experts plus a bias.

The MoA's query and output projections run as the MoE's experts do (fused_moe.ExpertGroups: grouped matmuls over the
token-expert pairs sorted by expert), each token's chosen experts' alone. Under tensor parallelism the experts' query
and output projections, kv_proj and the MoE shard over the KV heads and the intermediate size; routers and biases are
replicated."""
import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.fused_moe import ExpertGroups, FusedMoE, select_experts_topk_softmax
from nanoinfer.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, copy_weight
from nanoinfer.layers.rotary_embedding import get_rope
from nanoinfer.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from nanoinfer.utils.dist import tp_group, tp_rank, tp_size


def check_config(config: PretrainedConfig) -> None:
    if config.activation_function != "silu":
        raise ValueError(f"activation_function={config.activation_function!r} in the model config: only 'silu' is "
                         "implemented")
    if config.num_key_value_heads % tp_size():
        raise ValueError(f"tensor_parallel_size={tp_size()} does not divide the model's num_key_value_heads "
                         f"({config.num_key_value_heads})")


class JetMoeRouter(nn.Module):
    """transformers' JetMoeTopKGating: a replicated linear `layer` scoring the experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.layer = ReplicatedLinear(hidden_size, num_experts)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts_topk_softmax(self.layer(x), self.top_k)


class JetMoeMoA(nn.Module):
    """The attention experts' query projections `input_linear` [experts, this rank's query width, hidden] and output
    projections `output_linear` [experts, hidden, this rank's query width], this rank's KV heads of each, with the
    router and the output `bias`."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        experts, width = config.num_local_experts, config.num_key_value_heads * config.kv_channels
        self.width, self.local_width, self.start = width, width // tp_size(), tp_rank() * width // tp_size()
        self.input_linear = nn.Parameter(torch.empty(experts, self.local_width, config.hidden_size),
                                         requires_grad=False)
        self.output_linear = nn.Parameter(torch.empty(experts, config.hidden_size, self.local_width),
                                          requires_grad=False)
        self.bias = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.router = JetMoeRouter(config.hidden_size, experts, config.num_experts_per_tok)
        self.tp_size, self.tp_group = tp_size(), tp_group()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The experts' stacked tensors (this rank's query columns of each), or the bias whole."""
        if param is self.bias:
            copy_weight(param, loaded)
            return
        dim = 1 if param is self.input_linear else 2
        if loaded.dim() != 3 or loaded.shape[dim] != self.width:
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, expected {self.width} along "
                             f"dim {dim}")
        copy_weight(param, loaded.narrow(dim, self.start, self.local_width))

    def queries(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """x [tokens, hidden] -> each token's chosen experts' queries [tokens, k, this rank's query width]."""
        return groups.scatter(groups.linear(groups.token_rows(x), self.input_linear))

    def reduce(self, o: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """o [tokens, k, this rank's query width] -> the weighted sum of the chosen experts' output projections plus
        the bias, [tokens, hidden] (all-reduced over the ranks' heads)."""
        y = groups.linear(groups.pair_rows(o), self.output_linear) * groups.pair_rows(weights).to(o.dtype)[:, None]
        y = groups.scatter(y).sum(1)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return y + self.bias


class JetMoeAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__()
        check_config(config)
        self.head_dim, self.top_k = config.kv_channels, config.num_experts_per_tok
        self.num_kv_heads = config.num_key_value_heads // tp_size()
        kv_width = config.num_key_value_heads * self.head_dim
        self.kv_proj = MergedColumnParallelLinear(config.hidden_size, [kv_width, kv_width])
        self.experts = JetMoeMoA(config)
        self.rotary_emb = get_rope(config, self.head_dim, config.max_position_embeddings)
        # Query heads grouped by KV head (each KV head's k experts' heads together), as Attention pairs them.
        self.attn = Attention(self.num_kv_heads * self.top_k, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        weights, ids = self.experts.router(x)
        groups = ExpertGroups(ids, self.experts.input_linear.shape[0])
        q = self.experts.queries(x, groups).view(-1, self.top_k * self.num_kv_heads, self.head_dim)
        k, v = self.kv_proj(x).view(-1, 2, self.num_kv_heads, self.head_dim).unbind(1)
        if positions is not None:  # None: an encoder pass (see LLM.embed)
            q, k = self.rotary_emb(positions, q, k)
        q = q.view(-1, self.top_k, self.num_kv_heads, self.head_dim).transpose(1, 2)
        o = self.attn(q.flatten(1, 2), k, v, meta).view(-1, self.num_kv_heads, self.top_k, self.head_dim)
        return self.experts.reduce(o.transpose(1, 2).flatten(2), weights, groups)


class JetMoeMoE(nn.Module):
    """GraniteMoE's stacked experts (gate rows, then up rows), routed by JetMoE's router, plus a bias."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.router = JetMoeRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=False)
        self.bias = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *self.router(x)) + self.bias


class JetMoeDecoderLayer(LlamaDecoderLayer):
    attention_class = JetMoeAttention

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        # transformers' layers take RMSNorm's default epsilon; rms_norm_eps is the final norm's alone.
        self.input_layernorm.eps = self.post_attention_layernorm.eps = 1e-6


class JetMoeModel(LlamaModel):
    decoder_layer = JetMoeDecoderLayer


class JetMoeForCausalLM(LlamaForCausalLM):
    model_class = JetMoeModel
    packed_modules_mapping = {}
    weight_name_substitutions = {
        ".self_attention.": ".self_attn.",
        ".mlp.input_linear.weight": ".mlp.experts.gate_up_proj",
        ".mlp.output_linear.weight": ".mlp.experts.down_proj",
        ".experts.input_linear.weight": ".experts.input_linear",
        ".experts.output_linear.weight": ".experts.output_linear",
    }

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return JetMoeMoE(config)
