"""Inkling-2-Loop (`Inkling2LoopForCausalLM`; `Inkling2LoopForConditionalGeneration` read as text): Inkling-2
(inkling2.py) whose layers loop_layer_index_start to loop_layer_index_end run loop_num_passes times, each pass with KV
caches and conv states of its own (HRM-Text's InvocationAttention, ResidualConv's runs). Each pass after the first
starts again from the states before the loop, and its layers gate messages into their query, key, value and MLP
inputs: softmaxes over depth (a learned query per layer and input) of the previous pass's blocks and final state."""
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.fused_moe import Fp32Router
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.layers.recurrent import RecurrentBatch
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.hrm_text import InvocationAttention
from nanoinfer.models.inkling import ResidualConv
from nanoinfer.models.inkling2 import (HUB_NAMES, BlockAttentionResidual, Inkling2DecoderLayer, Inkling2ForCausalLM,
                                       Inkling2Model, check_inkling2_config, unweighted_rms_norm)

# The Hub's layout (what transformers' save_pretrained writes): Inkling-2's names, and the message gates' own, renamed
# as transformers' conversion_mapping ("inkling2_loop_text") reads them.
HUB_NAMES = HUB_NAMES | {
    ".controllers.attn.": ".q_message_gate.", ".controllers.k.": ".k_message_gate.",
    ".controllers.v.": ".v_message_gate.", ".controllers.mlp.": ".mlp_message_gate.",
    "_message_gate.down_weight": "_message_gate.down_proj.weight",
    "_message_gate.gain_weight": "_message_gate.message_gate_proj.weight",
    "_message_gate.forget_weight": "_message_gate.forget_gate_proj.weight"}
# The Hub's message queries: two [2 * loop layers, hidden] tensors, each layer's query and MLP queries, then (kv_) its
# key and value ones.
HUB_QUERIES = re.compile(r"middle_cycle_cross_pass_(kv_)?queries$")


def merge_message_queries(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hub's two message-query tensors as transformers' one, `message_input.query` [loop layers, 4, hidden] (each
    layer's query, key, value and MLP queries), once both have come; the other tensors as they come."""
    pending: dict[bool, torch.Tensor] = {}
    for name, tensor in weights:
        if (match := HUB_QUERIES.search(name)) is None:
            yield name, tensor
            continue
        pending[match[1] is not None] = tensor[...].unflatten(0, (-1, 2))
        if len(pending) == 2:
            qm, kv = pending.pop(False), pending.pop(True)
            yield name[:match.start()] + "message_input.query", torch.cat([qm[:, :1], kv, qm[:, 1:]], 1)


class MessageGate(nn.Module):
    """(1 - tanh(forget)) * x + tanh(gain) * message, in fp32; both gates projected from down_proj (the model's dtype)
    of x and the message, each RMS-normed without weight; the gates' projections fp32 (Fp32Router's: transformers
    keeps them in fp32)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.down_proj = ReplicatedLinear(2 * config.hidden_size, config.loop_gate_rank)
        self.forget_gate_proj, self.message_gate_proj = (
            Fp32Router(config.loop_gate_rank, config.hidden_size, fp32_weight=True) for _ in range(2))

    def forward(self, x: torch.Tensor, message: torch.Tensor) -> torch.Tensor:
        x, message = x.float(), message.float()
        g = torch.cat([unweighted_rms_norm(x, self.eps), unweighted_rms_norm(message, self.eps)], -1)
        g = self.down_proj(g.to(self.down_proj.weight.dtype))
        return (1 - torch.tanh(self.forget_gate_proj(g))) * x + torch.tanh(self.message_gate_proj(g)) * message


class Inkling2LoopDecoderLayer(Inkling2DecoderLayer):
    """A looped layer: a KV cache and conv states per pass (start_pass picks them); from the second pass on, its
    query, key, value and MLP inputs each gated with a message."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_message_gate, self.k_message_gate, self.v_message_gate, self.mlp_message_gate = (
            MessageGate(config) for _ in range(4))
        passes = config.loop_num_passes
        convs = [m for m in self.modules() if isinstance(m, ResidualConv)]
        for conv in convs:
            conv.add_runs(passes)
        self.self_attn.attn = InvocationAttention(self.self_attn.attn, passes)
        self.per_pass = (self.self_attn.attn, *convs)  # a plain tuple: each stays registered where it is

    def start_pass(self, index: int) -> None:
        for module in self.per_pass:
            module.invocation = index

    def forward(self, positions: torch.Tensor, h: torch.Tensor, blocks: list[torch.Tensor], meta: AttentionMetadata,
                batch: RecurrentBatch, messages: tuple[torch.Tensor, ...] | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """messages: the query, key, value and MLP inputs' from the previous pass (None: the first pass)."""
        if messages is None:
            return super().forward(positions, h, blocks, meta, batch)
        inputs = self.attention_inputs(h, blocks)
        inputs = inputs * (3 // len(inputs))  # a sliding layer's one input, gated three ways
        gates = (self.q_message_gate, self.k_message_gate, self.v_message_gate)
        gated = tuple(gate(x, message) for gate, x, message in zip(gates, inputs, messages))
        x, blocks = self.add_attention(h, blocks, self.attend(positions, gated, h.dtype, meta, batch), batch)
        return self.add_mlp(x, self.mlp_message_gate(self.mlp_input(blocks, x)[0], messages[3]), h.dtype, batch), blocks


class Inkling2LoopModel(Inkling2Model):
    def __init__(self, config: PretrainedConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        start, end = config.loop_layer_index_start, config.loop_layer_index_end
        self.passes = config.loop_num_passes
        # Plain tuples, not submodules: the layers stay registered once, under `layers`.
        self.before, self.looped, self.after = (
            tuple(self.layers[:start]), tuple(self.layers[start:end]), tuple(self.layers[end:]))
        self.message_input = BlockAttentionResidual(config.hidden_size, (end - start, 4))

    def loop_pass(self, index: int, positions: torch.Tensor, h: torch.Tensor, blocks: list[torch.Tensor],
                  meta: AttentionMetadata, batch: RecurrentBatch, messages: tuple[torch.Tensor, ...] | None
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """messages: four per looped layer (None: the first pass)."""
        for i, layer in enumerate(self.looped):
            layer.start_pass(index)
            own = None if messages is None else messages[4 * i:4 * i + 4]
            h, blocks = layer(positions, h, blocks, meta, batch, own)
        return h, blocks

    def run_layers(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h, blocks = self.run(self.before, positions, h, [], meta, batch)
        out, out_blocks = self.loop_pass(0, positions, h, blocks, meta, batch, None)
        for index in range(1, self.passes):
            # The pass's blocks but its first, which holds the states before the loop (its first layer closes them).
            messages = self.message_input(out_blocks[len(blocks) + 1:], out)
            out, out_blocks = self.loop_pass(index, positions, h, blocks, meta, batch, messages)
        return self.run(self.after, positions, out, out_blocks, meta, batch)


def check_inkling2_loop_config(config: PretrainedConfig) -> None:
    """Inkling-2's checks, transformers' own of the loop (at least one pass; its ends after layer 0 and on block
    boundaries), and a loop that ends before it starts (transformers fails on a negative size)."""
    check_inkling2_config(config)
    config.validate_architecture()
    start, end = config.loop_layer_index_start, config.loop_layer_index_end
    if end < start:
        raise ValueError(f"loop_layer_index_end={end} in {config_source(config)} is before "
                         f"loop_layer_index_start={start}")


class Inkling2LoopForCausalLM(Inkling2ForCausalLM):
    weight_name_substitutions = HUB_NAMES
    model_class = Inkling2LoopModel
    check_config = staticmethod(check_inkling2_loop_config)

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        looped = config.loop_layer_index_start <= layer_idx < config.loop_layer_index_end
        return (Inkling2LoopDecoderLayer if looped else Inkling2DecoderLayer)(config, layer_idx)

    @staticmethod
    def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Inkling-2's conversion, the Hub's message queries merged."""
        return merge_message_queries(Inkling2ForCausalLM.convert_checkpoint(weights))
