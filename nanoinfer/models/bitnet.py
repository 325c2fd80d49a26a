"""BitNet b1.58 (`BitNetForCausalLM`), in the unquantized checkpoint layout (its bf16 weights, as in
microsoft/bitnet-b1.58-2B-4T-bf16): Llama with an RMSNorm over the attention's output before o_proj (`attn_sub_norm`)
and one over the MLP's gated activations before down_proj (`ffn_sub_norm`), relu2 as the gate's activation. A
`quantization_config` (the packed ternary weights, quant_method "bitnet") is refused by name on load
(utils/quantization.py). Under tensor parallelism both sub-norms span the ranks' slices (ShardedRMSNorm)."""
import torch
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import ShardedRMSNorm
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP


class BitNetMLP(LlamaMLP):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.ffn_sub_norm = ShardedRMSNorm(config.intermediate_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ffn_sub_norm(self.act_fn(self.gate_up_proj(x))))


class BitNetForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, output_norm=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> LlamaMLP:
        return BitNetMLP(config)
