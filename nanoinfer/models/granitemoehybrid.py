"""IBM Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 layers and attention layers by `layer_types`, the
attention with or without rope (`position_embedding_type`), Granite's multipliers, and after each a shared MLP, plus
routed experts (GraniteMoe's) when `num_local_experts` > 0."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.bamba import mamba2_or_attention
from nanoinfer.models.granitemoe import GraniteMoeBlock, GraniteMoeForCausalLM
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaMLP


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    weight_name_substitutions = {
        ".mamba.": ".mixer.",
        **GraniteMoeForCausalLM.weight_name_substitutions,
    }

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        bias = config.attention_bias
        options = AttentionOptions(qkv_bias=bias, o_bias=bias, scale=config.attention_multiplier,
                                   rope=config.position_embedding_type == "rope")  # transformers' rule
        mixer, is_attention = mamba2_or_attention(config, layer_idx, options)
        # The shared MLP alone (dense), or beside the experts as GraniteMoeShared's.
        mlp = GraniteMoeBlock(config) if config.num_local_experts else LlamaMLP(config,
                                                                                config.shared_intermediate_size)
        return HybridDecoderLayer(config, mixer, is_attention, mlp, config.rms_norm_eps, config.residual_multiplier)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, config.rms_norm_eps, config.embedding_multiplier, config.logits_scaling)
        if not config.num_local_experts:  # the shared MLP is the layer's whole MLP
            self.weight_name_substitutions = {".mamba.": ".mixer.", ".shared_mlp.input_linear.": ".mlp.gate_up_proj.",
                                              ".shared_mlp.output_linear.": ".mlp.down_proj."}
