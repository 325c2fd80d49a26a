"""Arcee (AFM): Llama with a non-gated MLP, down(relu(up(x)) ** 2) ("relu2"), biases on it where `mlp_bias`.
Cosmos3 Edge's reasoner (`cosmos3_edge_text`) is these layers too (Cosmos3EdgeTextForCausalLM)."""
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.layernorm_decoder import DenseMLP
from nanoinfer.models.llama import LlamaForCausalLM

# The dense MLP's names (its up / down projections are Llama's, not merged with a gate).
DENSE_MLP_NAMES = {".mlp.up_proj.": ".mlp.fc1.", ".mlp.down_proj.": ".mlp.fc2."}


class ArceeForCausalLM(LlamaForCausalLM):
    weight_name_substitutions = DENSE_MLP_NAMES

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, config.mlp_bias)


# Cosmos3 Edge's generator beside its reasoner, whose tensors transformers drops on loading (its
# `_keys_to_ignore_on_load_unexpected`): at the top of the Hub's composite checkpoint (or under
# `model.language_model.`) and within the reasoner's layers.
_COSMOS3_EDGE_GENERATOR = re.compile(
    r"^(model\.language_model\.)?(action_modality_embed$|action_proj_(in|out)\.|time_embedder\.|proj_(in|out)\.|"
    r"norm_moe_gen\.|layers\.\d+\.(input_layernorm_moe_gen|post_attention_layernorm_moe_gen|mlp_moe_gen)\.|"
    r"layers\.\d+\.self_attn\.(add_[qkv]_proj|to_add_out|norm_added_[qk]|k_norm_und_for_gen)\.)")


class Cosmos3EdgeTextForCausalLM(ArceeForCausalLM):
    """Cosmos3 Edge's reasoner, the language model of `Cosmos3EdgeForConditionalGeneration` (see vision_language.py;
    its interleaved multimodal rope is the 1-D rope on text): the Hub's composite checkpoint keeps it at the top, its
    attention under diffusers' names, its MLP's as Arcee's Hub files; the generator's tensors are skipped."""
    weight_name_substitutions = {"^embed_tokens.": "model.embed_tokens.", "^norm.": "model.norm.",
                                 "^layers.": "model.layers.", ".self_attn.to_q.": ".self_attn.q_proj.",
                                 ".self_attn.to_k.": ".self_attn.k_proj.", ".self_attn.to_v.": ".self_attn.v_proj.",
                                 ".self_attn.to_out.": ".self_attn.o_proj.", **DENSE_MLP_NAMES}

    @staticmethod
    def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, tensor) for name, tensor in weights if not _COSMOS3_EDGE_GENERATOR.match(name))
