"""RecurrentGemma (`RecurrentGemmaForCausalLM`, Griffin): Gemma's pre-norm residual blocks whose token mixer is, by
`block_types` (repeated over the layers), either an RG-LRU recurrent block or local attention (a sliding window of
`attention_window_size`, rope over half of each head, a bias on o_proj), each followed by a GeGLU MLP with biases;
(1 + w) RMSNorms, the embedding times sqrt(hidden_size) rounded to bf16 (transformers' normalizer buffer), logits
soft-capped. The recurrent block: gelu(linear_y(x)) * RG-LRU(conv(linear_x(x))) -> linear_out, the conv and the LRU
state kept per sequence in recurrent-state slots."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import get_act
from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from nanoinfer.layers.mamba import scan_chunk
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer, RowShardedWeight
from nanoinfer.models.config_checks import check_each_in, config_source
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP
from nanoinfer.utils.dist import tp_size

BLOCK_TYPES = ("recurrent", "attention")


def check_config(config: PretrainedConfig) -> None:
    """transformers runs any block type other than "recurrent" as attention; names beyond the two are refused, as is
    an empty list (the layers repeat it)."""
    if not config.block_types:
        raise ValueError(f"block_types={config.block_types!r} in {config_source(config)} is not supported; expected "
                         f"at least one of {BLOCK_TYPES} (the layers repeat them)")
    check_each_in(config, "block_types", BLOCK_TYPES)
    if config.lru_width % config.num_attention_heads or config.num_attention_heads % tp_size():
        raise ValueError(f"lru_width={config.lru_width} in {config_source(config)} must split into "
                         f"num_attention_heads={config.num_attention_heads} RG-LRU blocks, and those over "
                         f"tensor_parallel_size={tp_size()}")


def block_types(config: PretrainedConfig) -> list[str]:
    """Each layer's block type, `block_types` repeated (transformers 5.23's `layers_block_type` renames them, 5.17's
    does not)."""
    return [config.block_types[i % len(config.block_types)] for i in range(config.num_hidden_layers)]


def rg_lru_step(a: torch.Tensor, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token of each of S sequences: h = a h + x in fp32 (state [S, C], updated in place) -> h in x's dtype."""
    state.mul_(a.to(state.dtype)).add_(x.to(state.dtype))
    return state.to(x.dtype, copy=True)


def rg_lru_sequence(a: torch.Tensor, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The n tokens of one sequence: a, x [n, C], state [C] before the first -> (every h [n, C] in x's dtype, the last
    h). Mamba's chunk scan: one fused op per token on CPUs, the parallel scan on GPUs."""
    h = x.to(state.dtype, copy=True)
    h[0] += a[0].to(state.dtype) * state
    scan_chunk(a.to(state.dtype).clone(), h, parallel=x.device.type != "cpu")
    return h.to(x.dtype), h[-1].clone()


class RecurrentGemmaRecurrentBlock(RecurrentLayer):
    """Griffin's recurrent block. Under tensor parallelism each rank holds its RG-LRU heads (blocks of lru_width /
    num_attention_heads channels): their linear_x / linear_y rows, conv channels, gate blocks, recurrent_param and
    state, and linear_out's input columns (one all-reduce)."""

    def __init__(self, config: PretrainedConfig):
        width, heads = config.lru_width, config.num_attention_heads
        channels = width // tp_size()
        super().__init__(config.conv1d_width, channels, (channels,))
        self.num_heads, self.block_width = heads // tp_size(), width // heads
        self.linear_x = ColumnParallelLinear(config.hidden_size, width, bias=True)
        self.linear_y = ColumnParallelLinear(config.hidden_size, width, bias=True)
        self.linear_out = RowParallelLinear(width, config.hidden_size, bias=True)
        self.conv_1d = RowShardedWeight([(width, True)], (1, config.conv1d_width), bias=True)  # runs in causal_conv
        self.act_fn = get_act(config.hidden_activation)
        # The RG-LRU's parameters (the checkpoint's `rg_lru.*`), loaded by RecurrentLayer.weight_loader: this rank's
        # heads (dim 0).
        empty = lambda *shape: nn.Parameter(torch.empty(*shape), requires_grad=False)  # noqa: E731
        self.recurrent_param = empty(channels)
        self.input_gate_weight = empty(self.num_heads, self.block_width, self.block_width)
        self.input_gate_bias = empty(self.num_heads, self.block_width)
        self.recurrent_gate_weight = empty(self.num_heads, self.block_width, self.block_width)
        self.recurrent_gate_bias = empty(self.num_heads, self.block_width)

    def gate(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """sigmoid of each head's block-diagonal linear, x [tokens, channels], as transformers' baddbmm."""
        heads = x.view(-1, self.num_heads, self.block_width).transpose(0, 1)
        return torch.baddbmm(bias[:, None, :], heads, weight).transpose(0, 1).reshape(x.shape).sigmoid()

    def rg_lru(self, x: torch.Tensor, positions: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        """h_t = a_t h_(t-1) + sqrt(1 - a_t^2) (i_t x_t), with a_t = exp(-8 r_t softplus(recurrent_param)) and the
        input and recurrence gates i_t, r_t; at position 0 the input is not scaled (the state there is zero)."""
        log_a = -8.0 * self.gate(x, self.recurrent_gate_weight, self.recurrent_gate_bias) * F.softplus(
            self.recurrent_param)
        multiplier = torch.where((positions == 0)[:, None], 1.0, torch.sqrt(1 - torch.exp(2 * log_a)))
        normalized = x * self.gate(x, self.input_gate_weight, self.input_gate_bias) * multiplier.to(x.dtype)
        return self.scan(batch, rg_lru_step, rg_lru_sequence, torch.exp(log_a), normalized)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        y = self.act_fn(self.linear_y(hidden_states))
        x = self.causal_conv(self.linear_x(hidden_states), self.conv_1d.weight.squeeze(1), batch, self.conv_1d.bias,
                             silu=False)
        return self.linear_out(self.rg_lru(x, positions, batch) * y)


class RecurrentGemmaDecoderLayer(HybridDecoderLayer):
    """The hybrid layer whose recurrent mixer also reads the positions (the RG-LRU's reset at position 0)."""

    def mix(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch
            ) -> torch.Tensor:
        return self.self_attn(positions, x, meta) if self.is_attention_layer else self.mixer(x, positions, batch)


class RecurrentGemmaForCausalLM(HybridForCausalLM):
    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        is_attention = block_types(config)[layer_idx] == "attention"
        if is_attention:
            options = AttentionOptions(qkv_bias=config.attention_bias, o_bias=True,
                                       sliding_window=config.attention_window_size)
            mixer = LlamaAttention(config, options)
        else:
            mixer = RecurrentGemmaRecurrentBlock(config)
        mlp = LlamaMLP(config, config.intermediate_size // 2, config.hidden_activation, bias=True)
        return RecurrentGemmaDecoderLayer(config, mixer, is_attention, mlp, config.rms_norm_eps, norm=GemmaRMSNorm)

    def make_final_norm(self, config: PretrainedConfig, eps: float) -> GemmaRMSNorm:
        return GemmaRMSNorm(config.hidden_size, eps)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        # transformers' normalizer: a bf16 buffer, cast to the model's dtype.
        normalizer = torch.tensor(config.hidden_size ** 0.5, dtype=torch.bfloat16).item()
        super().__init__(config, config.rms_norm_eps, embedding_multiplier=normalizer,
                         logit_softcap=config.logits_soft_cap)
        mixers = {"attention": "self_attn", "recurrent": "mixer"}  # HybridDecoderLayer's names
        self.weight_name_substitutions = {
            **{f"^model.layers.{i}.temporal_block.": f"model.layers.{i}.{mixers[block_type]}."
               for i, block_type in enumerate(block_types(config))},
            ".rg_lru.": ".", ".temporal_pre_norm.": ".input_layernorm.",
            ".channel_pre_norm.": ".post_attention_layernorm.", ".mlp_block.": ".mlp.", "^model.final_norm.": "model.norm."}
