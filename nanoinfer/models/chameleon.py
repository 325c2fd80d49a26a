"""Chameleon (`ChameleonForConditionalGeneration`: Meta's Chameleon, Anole), run as a text model: Llama with a
LayerNorm of each head's own (weight and bias, epsilon fixed at 1e-5) on its query and key before rope, norms before
the sublayers or (`swin_norm`) after them, h = x + norm(attn(x)); out = h + norm(mlp(h)). Images are VQ tokens of the
vocabulary: the VQ model (`model.vqmodel.*`) is not loaded, and the logits of the image tokens (the
`vocabulary_map` entries named IMGIMG*) are the model dtype's minimum, as transformers' wrapper sets them."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import PerHeadLayerNorm
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.layernorm_decoder import QKLayerNormAttention
from nanoinfer.models.llama import (AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, MLPFactory,
                                    OptionsFactory)

# transformers' ChameleonLayerNorm takes no epsilon from the config: F.layer_norm's 1e-5, whatever rms_norm_eps says.
QK_NORM_EPS = 1e-5
# The vocabulary_map names of the image tokens (the VQ codes as BPE tokens), as ChameleonImageVocabularyMapping reads
# them.
IMAGE_TOKEN_PREFIX = "IMGIMG"


class ChameleonQKNorm(PerHeadLayerNorm):
    """transformers' ChameleonLayerNorm on x [tokens, heads, head_dim]: each head normalized over its own features,
    then its own weight and bias (the checkpoint's [heads, head_dim], this rank's heads as PerHeadLayerNorm takes
    them). Rounded as transformers rounds it: the normalized x in x's dtype, then the product, then the sum."""

    def __init__(self, total_heads: int, head_dim: int):
        super().__init__(total_heads, head_dim, QK_NORM_EPS)
        self.bias = nn.Parameter(torch.zeros(self.num_heads, head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight + self.bias


class ChameleonAttention(QKLayerNormAttention):
    """Llama's attention with ChameleonQKNorm on each head's query and key, before rope."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(config, options, ChameleonQKNorm)


class ChameleonDecoderLayer(LlamaDecoderLayer):
    """Norms before the sublayers (Llama's layer)."""

    attention_class = ChameleonAttention


class ChameleonSwinDecoderLayer(ChameleonDecoderLayer):
    """`swin_norm`: each sublayer takes the residual stream itself, and its output is normed before it is added:
    h = x + input_layernorm(attn(x)); out = h + post_attention_layernorm(mlp(h))."""

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: the stream is x + residual, the add left to the next layer (or the final norm)."""
        if residual is not None:
            x = x + residual
        h = x + self.input_layernorm(self.self_attn(positions, x, meta))
        return self.post_attention_layernorm(self.mlp(h)), h


class ChameleonModel(LlamaModel):
    def make_layer(self, config: PretrainedConfig, layer_idx: int, attention_options: OptionsFactory,
                   make_mlp: MLPFactory) -> nn.Module:
        layer_class = ChameleonSwinDecoderLayer if config.swin_norm else ChameleonDecoderLayer
        return layer_class(config, attention_options(config, layer_idx), make_mlp(config, layer_idx))


def image_token_ids(config: PretrainedConfig) -> list[int]:
    """The ids of the image tokens, those whose logits transformers' wrapper suppresses; a config without a
    vocabulary_map (transformers cannot build such a model) or with ids off the vocabulary is refused by name."""
    vocabulary_map = getattr(config, "vocabulary_map", None)
    if not isinstance(vocabulary_map, dict):
        raise ValueError(f"vocabulary_map={vocabulary_map!r} in {config_source(config)} is not supported: Chameleon "
                         f"needs the tokenizer's vocabulary map to know its image tokens")
    ids = sorted(i for name, i in vocabulary_map.items() if name.startswith(IMAGE_TOKEN_PREFIX))
    outside = [i for i in ids if not 0 <= i < config.vocab_size]
    if outside:
        raise ValueError(f"vocabulary_map in {config_source(config)} gives image tokens ids {outside[:5]} outside the "
                         f"vocabulary of vocab_size={config.vocab_size}")
    return ids


class ChameleonForConditionalGeneration(LlamaForCausalLM):
    model_class = ChameleonModel
    # transformers' module names the checkpoint's q_norm / k_norm; QKLayerNormAttention's are these.
    weight_name_substitutions = {".self_attn.q_norm.": ".self_attn.q_layernorm.",
                                 ".self_attn.k_norm.": ".self_attn.k_layernorm."}
    ignored_weight_prefixes = ("model.vqmodel.",)  # the image tokenizer: text needs none of it

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        # Heads hidden_size / num_attention_heads wide, as transformers' (a config's head_dim is not read).
        return AttentionOptions(qkv_bias=bias, o_bias=bias, head_dim=config.hidden_size // config.num_attention_heads)

    def __init__(self, config: PretrainedConfig):
        ids = image_token_ids(config)
        super().__init__(config)
        # A buffer, on the model's device: the suppression reads no host value (decode graphs capture it).
        self.register_buffer("image_token_ids", torch.tensor(ids, dtype=torch.long), persistent=False)
        # transformers' logits are in the model's dtype and take that dtype's minimum; ours, fp32, take the same value.
        self.suppressed_logit = torch.finfo(torch.get_default_dtype()).min

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        return None if logits is None else logits.index_fill_(-1, self.image_token_ids, self.suppressed_logit)
