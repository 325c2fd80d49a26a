"""OLMoE: OLMo 2's attention (RMSNorms over the whole q and k projections before rope; q, k and v optionally clamped
to +-`clip_qkv`) in the pre-norm Llama layer, whose MLP is each token's top k of `num_experts` softmax-routed
experts, rescaled to sum to 1 where `norm_topk_prob`. FlexOLMo: OLMo 2's whole layer (norms after the sublayers, no
clamping) around OLMoE's experts."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import SparseMoeBlock
from nanoinfer.models.llama import LlamaDecoderLayer, LlamaModel
from nanoinfer.models.olmo import OlmoForCausalLM
from nanoinfer.models.olmo2 import Olmo2Attention, Olmo2ForCausalLM


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Olmo2Attention


class OlmoeModel(LlamaModel):
    decoder_layer = OlmoeDecoderLayer


class OlmoeForCausalLM(Olmo2ForCausalLM):
    model_class = OlmoeModel
    attention_options = staticmethod(OlmoForCausalLM.attention_options)  # biases and clip_qkv as OLMo 1

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config, config.num_experts, config.intermediate_size, config.norm_topk_prob)


class FlexOlmoForCausalLM(Olmo2ForCausalLM):
    make_mlp = staticmethod(OlmoeForCausalLM.make_mlp)
