"""Dory (`DoryForCausalLM`, NVIDIA's looped nGPT): Gemma 2's four-norm layer with every norm a weightless L2 norm
(states on the unit sphere) and the residual an interpolation towards each sublayer's normed output at learned rates;
AFMoE's gated attention (q/k L2-normed per head, Gemma 3's rope per layer type on every layer) with nGPT's query and
gate scales; a recurrent section of layers run `n_recurrent_loops` times between the input and output layers, each
run with a KV cache of its own (HRM-Text's InvocationAttention); the logits times a learned scale per token."""
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import L2Norm
from nanoinfer.layers.recurrent import load_rank_rows
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.gemma2 import check_layer_types
from nanoinfer.models.hrm_text import InvocationAttention
from nanoinfer.models.llama import (AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel,
                                    MLPFactory, OptionsFactory, layer_sliding_window)
from nanoinfer.utils.dist import tp_size

# Released checkpoints store each layer as an attention block `layers.{2i}` and an MLP block `layers.{2i + 1}`, their
# sublayers as `mixer`, the residual rates as `attn_alpha` and `mlp_alpha` (transformers' LayerPairCollapse).
_BLOCK = re.compile(r"layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)")
_RATES = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}


def _layer_part(block: re.Match) -> str:
    index, part = int(block[1]), block[2]
    return f"layers.{index // 2}.{_RATES.get(part, ('self_attn', 'mlp')[index % 2])}"


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    config.validate_architecture()  # transformers' own: the sections fill the layers, at least one loop
    check_layer_types(config)
    if config.recurrent_kv_cache_mode != "per_loop" and config.n_recurrent_loops > 1:
        raise ValueError(
            f"recurrent_kv_cache_mode={config.recurrent_kv_cache_mode!r} in {config_source(config)} is not supported "
            f"with n_recurrent_loops={config.n_recurrent_loops}: its loops before the last read the last loop's keys "
            "and values of earlier forward passes' tokens, so transformers' outputs depend on how a sequence is split "
            "into passes (chunked prefill, prefix cache hits and preemption split it otherwise); expected 'per_loop'")


class DoryAttention(LlamaAttention):
    """q and k L2-normed per head before rope, each query channel then times (sqk * sqrt(head_dim) /
    initializer_range)^2; the output times sigmoid(gate * (s_gate * hidden^(1/4) / initializer_range)^2) in the model's
    dtype, as transformers computes it, then L2-normed over all heads before o_proj."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(config, options)
        width = self.num_heads * self.head_dim  # this rank's heads
        self.sqk, self.s_gate = (nn.Parameter(torch.empty(width), requires_grad=False) for _ in range(2))
        self.sqk_scale = self.head_dim ** 0.5 / config.initializer_range
        self.s_gate_scale = config.hidden_size ** 0.25 / config.initializer_range
        self.head_norm = L2Norm()
        self.attn_sub_norm = L2Norm(sharded=True)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = self.head_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.head_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        if positions is not None:  # None: an encoder pass (LLM.embed)
            q, k = self.rotary_emb(positions, q, k)
        q = q * (self.sqk * self.sqk_scale).square().view(self.num_heads, self.head_dim)
        o = self.attn(q, k, v, meta)
        o = o * torch.sigmoid(self.g_proj(x) * (self.s_gate * self.s_gate_scale).square())
        return self.o_proj(self.attn_sub_norm(o))


class DoryMLP(LlamaMLP):
    """Gate and up times (suv_gate, suv_up) * sqrt(hidden) per channel, the gated activations L2-normed (across the
    ranks' slices) before down_proj."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        width = config.intermediate_size // tp_size()
        self.suv_gate, self.suv_up = (nn.Parameter(torch.empty(width), requires_grad=False) for _ in range(2))
        self.suv_scale = config.hidden_size ** 0.5
        self.ffn_sub_norm = L2Norm(sharded=True)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """suv_gate, suv_up: this rank's channels, as gate_up_proj's."""
        load_rank_rows(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.cat((self.suv_gate, self.suv_up)) * self.suv_scale  # gate_up_proj's rows: gate's, then up's
        return self.down_proj(self.ffn_sub_norm(self.act_fn(self.gate_up_proj(x) * scale)))


class DoryDecoderLayer(nn.Module):
    """x L2-normed, then moved towards the normed attention output at the rate |lambda_1| * ngpt_alpha_init /
    initializer_range per channel; normed again, then towards the normed MLP output at lambda_2's rate. Called as
    (positions, x, meta) -> x: the states are the residual stream."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__()
        self.self_attn = DoryAttention(config, options)
        self.mlp = mlp
        self.norm = L2Norm()
        self.lambda_1, self.lambda_2 = (nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
                                        for _ in range(2))
        self.lambda_scale = config.ngpt_alpha_init / config.initializer_range

    def towards(self, x: torch.Tensor, out: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
        return x + (rate * self.lambda_scale).abs() * (self.norm(out) - x)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.norm(x)
        x = self.norm(self.towards(x, self.self_attn(positions, x, meta), self.lambda_1))
        return self.towards(x, self.mlp(x), self.lambda_2)


class DoryModel(LlamaModel):
    """The input layers, then the recurrent ones n_recurrent_loops times, each loop starting from the sum of its input
    and the input layers' output (both normed), then the output layers and the final norm."""

    decoder_layer = DoryDecoderLayer

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.loops = config.n_recurrent_loops
        start, stop = config.n_input_layers, config.n_input_layers + config.n_recurrent_layers
        # Plain tuples, not submodules: the layers stay registered once, under `layers`.
        self.input_layers, self.recurrent_layers, self.output_layers = (
            tuple(self.layers[:start]), tuple(self.layers[start:stop]), tuple(self.layers[stop:]))
        for layer in self.recurrent_layers:
            layer.self_attn.attn = InvocationAttention(layer.self_attn.attn, self.loops)

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return L2Norm()

    @staticmethod
    def run(layers: tuple[nn.Module, ...], positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor:
        for layer in layers:
            x = layer(positions, x, meta)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        x = self.run(self.input_layers, positions, self.embed(input_ids, positions), meta)
        first = self.norm(x)
        for loop in range(self.loops):
            for layer in self.recurrent_layers:
                layer.self_attn.attn.invocation = loop
            x = self.run(self.recurrent_layers, positions, self.norm(x) + first, meta)
        return self.norm(self.run(self.output_layers, positions, x, meta))


class DoryForCausalLM(LlamaForCausalLM):
    model_class = DoryModel
    weight_name_substitutions = {
        "^backbone.": "model.",
        ".embeddings.": ".embed_tokens.",
        ".self_attn.gate_proj.": ".self_attn.g_proj.",  # transformers' name; not an MLP's gate (packed_modules_mapping)
        "^lm_head.logit_scale": "logit_scale",
    }

    @staticmethod
    def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, those of a released one's blocks renamed after their layers' parts."""
        for name, tensor in weights:
            yield _BLOCK.sub(_layer_part, name), tensor

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        # gate_activation: the gate's projection (g_proj); transformers' default rope spans the whole head, whatever a
        # partial_rotary_factor says.
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sliding_window=layer_sliding_window(config, layer_idx),
                                gate_activation=torch.sigmoid, rope_layer_type=config.layer_types[layer_idx],
                                rotary_dim=config.head_dim)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DoryMLP(config)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
        # All the vocabulary's on every rank: rank 0 scales the gathered logits.
        self.logit_scale = nn.Parameter(torch.empty(config.vocab_size), requires_grad=False)
        self.logit_scale_factor = 1 / config.initializer_range

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        return None if logits is None else logits * (self.logit_scale.float() * self.logit_scale_factor)
