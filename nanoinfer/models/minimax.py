"""MiniMax-Text-01 (`MiniMaxForCausalLM`): lightning attention layers (linear attention with a fixed exponential decay
per head) and softmax attention layers (Mistral's: rope, GQA, the config's window) as `layer_types` says, each
followed by Mixtral's MoE. Lightning attention is the gated delta rule's recurrence without the delta rule
(layers/gated_delta_rule.py): S_t = e^-s S_(t-1) + k_t v_t^T, o_t = q_t S_t over SiLU'd q, k, v, the decay s of
head h ALiBi's slope (2^(-8/H))^(h+1), scaled down towards the last layer; its output is RMSNormed over all heads
together and gated by sigmoid(output_gate(x)). The layer's residuals are its normed inputs, weighed by the config's
alpha and beta factors. Under tensor parallelism lightning attention shards by heads (its projection rows, state and
out_proj's columns; the norm's mean square summed over ranks), the rest as Mixtral. Prefix caching is off, as for
the other hybrids (a cached prefix has K/V but no recurrent state)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from nanoinfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer
from nanoinfer.models.hybrid import (HybridDecoderLayer, HybridForCausalLM, check_layer_config,
                                    mixers_named_self_attn)
from nanoinfer.models.llama import AttentionOptions, LlamaAttention
from nanoinfer.models.mixtral import MixtralForCausalLM
from nanoinfer.models.olmo2 import Olmo2QKNorm
from nanoinfer.utils.dist import tp_group, tp_rank, tp_size

# transformers' lightning-attention norm: RMSNorm's default epsilon, whatever rms_norm_eps says.
LIGHTNING_NORM_EPS = 1e-6


def decay_rates(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Each head's decay s per token (fp32), as transformers' MiniMaxLightningAttention.get_slope_rate."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(num_heads, dtype=torch.float32) + 1) * factor


def _lightning_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor
                    ) -> torch.Tensor:
    return recurrent_gated_delta_rule(q, k, v, g, None, state)


def _lightning_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    return chunk_gated_delta_rule(q, k, v, g, None, state)


class MiniMaxLightningAttention(RecurrentLayer):
    """Its state [heads, head_dim, head_dim] per sequence, for this rank's heads; no conv."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        heads, tp = config.num_attention_heads, tp_size()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        super().__init__(1, 0, (heads // tp, head_dim, head_dim))
        self.num_heads, self.head_dim = heads // tp, head_dim
        width = heads * head_dim
        # Rows grouped by head, [q, k, v] within each: a rank's share is its heads'.
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, 3 * width)
        self.output_gate = ColumnParallelLinear(config.hidden_size, width)
        # OLMo 2's norm of a whole projection, whose rank's share is its heads' (the weight applied in fp32 before the
        # rounding, where transformers' MiniMaxRMSNorm rounds first: the same in fp32).
        self.norm = Olmo2QKNorm(heads, head_dim, LIGHTNING_NORM_EPS)
        self.out_proj = RowParallelLinear(width, config.hidden_size)
        rank_heads = slice(tp_rank() * self.num_heads, (tp_rank() + 1) * self.num_heads)
        rates = decay_rates(heads, layer_idx, config.num_hidden_layers)[rank_heads]
        self.register_buffer("log_decay", -rates, persistent=False)
        self.tp_size, self.tp_group = tp, tp_group()

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        dtype = self.ssm_state.dtype
        qkv = F.silu(self.qkv_proj(x)).view(x.shape[0], self.num_heads, 3 * self.head_dim).to(dtype)
        q, k, v = qkv.split(self.head_dim, -1)
        g = self.log_decay.to(dtype).expand(x.shape[0], -1)
        out = self.scan(batch, _lightning_step, _lightning_chunks, q, k, v, g).flatten(1).to(x.dtype)
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * self.normalized(out))

    def normalized(self, out: torch.Tensor) -> torch.Tensor:
        """The RMSNorm over all heads' outputs: on several ranks, one all-reduce of the rows' mean squares."""
        if self.tp_size == 1:
            return self.norm(out)
        mean_square = out.float().pow(2).mean(-1, keepdim=True)
        dist.all_reduce(mean_square, group=self.tp_group)
        return self.norm.scale(out, mean_square / self.tp_size)


class MiniMaxDecoderLayer(HybridDecoderLayer):
    """h = norm(x); x = alpha h + beta mixer(h); then the same around the MoE with the MLP's factors: each sublayer's
    residual is its normed input, so no residual stream runs past the layer."""

    def __init__(self, config: PretrainedConfig, mixer: nn.Module, is_attention_layer: bool, mlp: nn.Module):
        super().__init__(config, mixer, is_attention_layer, mlp, config.rms_norm_eps)
        kind = "full_attn" if is_attention_layer else "linear_attn"
        self.mixer_factors = getattr(config, f"{kind}_alpha_factor"), getattr(config, f"{kind}_beta_factor")
        self.mlp_factors = config.mlp_alpha_factor, config.mlp_beta_factor

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, batch: RecurrentBatch) -> tuple[torch.Tensor, None]:
        x = self.input_layernorm(x)
        alpha, beta = self.mixer_factors
        x = self.post_attention_layernorm(x * alpha + self.mix(positions, x, meta, batch) * beta)
        alpha, beta = self.mlp_factors
        return x * alpha + self.mlp(x) * beta, None


class MiniMaxForCausalLM(HybridForCausalLM):
    # transformers' lightning-attention buffers, which its save_pretrained writes: computed here (log_decay).
    ignored_weight_suffixes = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        mlp = MixtralForCausalLM.make_mlp(config, layer_idx)
        if config.layer_types[layer_idx] == "linear_attention":
            return MiniMaxDecoderLayer(config, MiniMaxLightningAttention(config, layer_idx), False, mlp)
        attention = LlamaAttention(config, AttentionOptions(sliding_window=config.sliding_window))
        return MiniMaxDecoderLayer(config, attention, True, mlp)

    def __init__(self, config: PretrainedConfig):
        check_layer_config(config, "num_attention_heads", silu=True)
        super().__init__(config, config.rms_norm_eps)
        self.weight_name_substitutions = {**MixtralForCausalLM.weight_name_substitutions,
                                          **mixers_named_self_attn(config)}
