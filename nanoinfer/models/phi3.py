"""Phi-3 / Phi-4-mini: the Llama decoder whose checkpoints hold q/k/v and gate/up already fused (`qkv_proj`,
`gate_up_proj`), with partial rotary embedding, longrope scaling and a sliding window on every layer where set."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # Nothing to pack: the fused checkpoint tensors load whole, each layer's weight_loader taking this rank's rows
    # of every stacked part.
    packed_modules_mapping = {}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(sliding_window=getattr(config, "sliding_window", None))
