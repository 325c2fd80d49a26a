"""The decoders of encoder-decoder models run alone, as transformers' `*ForCausalLM` classes run them (BART, mBART,
Marian, Pegasus, Blenderbot, Blenderbot Small, PLBART, MVP, TrOCR, BigBird-Pegasus, Whisper): fairseq's layers
(q/k/v/out projections with biases, a dense MLP fc1 / fc2 with biases, LayerNorms at nn.LayerNorm's epsilon) whose
cross-attention transformers skips without encoder states, so its weights (`encoder_attn`, `encoder_attn_layer_norm`)
are dropped on loading. They differ by a handful of choices (Layout, by model_type): pre-LN layers with a final
LayerNorm or post-LN ones without; learned positions (offset by 2 rows for BART's descendants) or a fixed sinusoidal
table (sines | cosines of position / 10000 ** (2i / d), Marian's and Pegasus's: the checkpoint's where it holds one,
else computed); token embeddings times sqrt(d_model) where `scale_embedding`, in the lookup or after it (the decoders
of Whisper and Blenderbot Small never scale); a LayerNorm of the embeddings (`layernorm_embedding`) after the
positions are added (BART; TrOCR's where `layernorm_embedding`) or before (Blenderbot Small). Full seq2seq checkpoints
(`*ForConditionalGeneration`, `final_logits_bias`) are not registered: their generation needs the encoder."""
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.embed_head import ParallelLMHead, ScaledEmbedding
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.gpt2 import GPT2Model
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, ResidualSum
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, MLPFactory, OptionsFactory
from nanoinfer.models.opt import LAYER_NORM_EPS, OPTForCausalLM


@dataclass(frozen=True)
class Layout:
    pre_norm: bool  # pre-LN layers and a final LayerNorm (`layer_norm`); else post-LN layers and no final norm
    sinusoidal: bool = False  # Marian's / Pegasus's fixed table; else learned positions
    position_offset: int = 0  # rows of the learned table before position 0's
    embedding_norm: Literal["after-positions", "before-positions"] | None = None
    # Where the token embeddings are times sqrt(d_model) with `scale_embedding`: in the lookup (BART's scaled word
    # embedding, whose output prompt embeddings stand for), on the decoder's input embeddings (Marian, Pegasus: prompt
    # embeddings too), or nowhere (the decoders of Whisper and Blenderbot Small never scale).
    embed_scale: Literal["lookup", "inputs"] | None = "lookup"
    key_bias: bool = True  # Whisper's k_proj has none (loaded as zeros)
    positions_field: str = "max_position_embeddings"
    final_norm_name: str = "layer_norm"  # BigBird-Pegasus's final norm is named `layernorm_embedding`
    tied: bool = True  # the LM head tied where `tie_word_embeddings` (BigBird-Pegasus's class never ties it)


LAYOUTS = {
    "bart": Layout(pre_norm=False, position_offset=2, embedding_norm="after-positions"),
    "plbart": Layout(pre_norm=False, position_offset=2, embedding_norm="after-positions"),
    "mvp": Layout(pre_norm=False, position_offset=2, embedding_norm="after-positions"),
    "trocr": Layout(pre_norm=False, position_offset=2, embedding_norm="after-positions"),
    "mbart": Layout(pre_norm=True, position_offset=2, embedding_norm="after-positions"),
    "bigbird_pegasus": Layout(pre_norm=True, final_norm_name="layernorm_embedding", tied=False),
    "marian": Layout(pre_norm=False, sinusoidal=True, embed_scale="inputs"),
    "pegasus": Layout(pre_norm=True, sinusoidal=True, embed_scale="inputs"),
    "blenderbot": Layout(pre_norm=True),
    "blenderbot-small": Layout(pre_norm=False, embedding_norm="before-positions", embed_scale=None),
    "whisper": Layout(pre_norm=True, embed_scale=None, key_bias=False, positions_field="max_target_positions"),
}


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """MarianSinusoidalPositionalEmbedding.create_weight's table (Pegasus's too), [num_positions, dim]: sines of
    position / 10000 ** (2i / dim) in the first ceil(dim / 2) columns, their cosines after; computed in fp64 as its
    numpy does."""
    freqs = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles[:, :dim // 2])], dim=1).float()


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    # The engine checks the tensor-parallel split and the attention backend's head size by num_attention_heads, which
    # these configs map to the encoder's heads.
    if config.decoder_attention_heads != config.num_attention_heads:
        raise ValueError(f"decoder_attention_heads={config.decoder_attention_heads} in {config_source(config)} "
                         f"differs from encoder_attention_heads={config.num_attention_heads}: not supported")
    if getattr(config, "use_prompt", False):  # MVP's prompts: extra keys and values per layer
        raise ValueError(f"use_prompt=True in {config_source(config)}: not supported for {config.model_type}")
    if not getattr(config, "use_learned_position_embeddings", True):  # TrOCR's sinusoids count the non-pad tokens
        raise ValueError(f"use_learned_position_embeddings=False in {config_source(config)}: not supported for "
                         f"{config.model_type}")
    vocab = getattr(config, "decoder_vocab_size", None)  # Marian's
    if vocab is not None and vocab != config.vocab_size:
        raise ValueError(f"decoder_vocab_size={vocab} in {config_source(config)} differs from "
                         f"vocab_size={config.vocab_size}: not supported")


class Seq2SeqDecoderModel(GPT2Model):
    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        self.layout = LAYOUTS[config.model_type]
        self.position_offset = self.layout.position_offset
        super().__init__(config, attention_options, make_mlp)
        # TrOCR's config says whether it has one (`layernorm_embedding`); the others' layouts alone.
        self.embedding_norm_at = self.layout.embedding_norm if getattr(config, "layernorm_embedding", True) else None
        self.embedding_norm = None if self.embedding_norm_at is None else LayerNorm(config.d_model, LAYER_NORM_EPS)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, attention_options: OptionsFactory,
                   make_mlp: MLPFactory) -> nn.Module:
        return LayerNormDecoderLayer(LlamaAttention(config, attention_options(config, layer_idx)),
                                     make_mlp(config, layer_idx), config.d_model, LAYER_NORM_EPS,
                                     "sequential" if self.layout.pre_norm else "post-norm")

    @staticmethod
    def num_layers(config: PretrainedConfig) -> int:
        return config.decoder_layers

    def scale(self, config: PretrainedConfig, where: str) -> float:
        return config.d_model ** 0.5 if self.layout.embed_scale == where and config.scale_embedding else 1.0

    def token_embedding(self, config: PretrainedConfig) -> nn.Module:
        return ScaledEmbedding(config.vocab_size, config.d_model, self.scale(config, "lookup"))

    def embedding_scale(self, config: PretrainedConfig) -> float:
        return self.scale(config, "inputs")

    def final_norm(self, config: PretrainedConfig) -> nn.Module:
        return LayerNorm(config.d_model, LAYER_NORM_EPS) if self.layout.pre_norm else ResidualSum()

    def position_embedding(self, config: PretrainedConfig) -> nn.Module:
        """Learned, or the sinusoidal table: a parameter too (transformers' is, loaded from the checkpoint where it
        holds one)."""
        wpe = nn.Embedding(getattr(config, self.layout.positions_field) + self.position_offset, config.d_model)
        wpe.weight.requires_grad_(False)
        return wpe

    def add_positions(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        norm = self.embedding_norm_at
        if norm == "before-positions":
            x = self.embedding_norm(x)
        x = super().add_positions(x, positions)
        return self.embedding_norm(x) if norm == "after-positions" else x


class Seq2SeqDecoderForCausalLM(LlamaForCausalLM):
    model_class = Seq2SeqDecoderModel
    # transformers' *ForCausalLM files: the decoder under `model.decoder.`, the LM head `lm_head` (Whisper's
    # `proj_out`, TrOCR's `output_projection`); then OPT's names for the layers' parts.
    weight_name_substitutions = {"^proj_out.": "lm_head.", "^output_projection.": "lm_head.",
                                 "^model.decoder.layer_norm.": "model.norm.",
                                 "^model.decoder.layernorm_embedding.": "model.embedding_norm.",
                                 "^model.decoder.embed_positions.": "model.wpe.",
                                 **OPTForCausalLM.weight_name_substitutions}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        heads = config.decoder_attention_heads
        bias = getattr(config, "use_bias", True)  # BigBird-Pegasus's q/k/v/out biases, where set
        return AttentionOptions(qkv_bias=bias, o_bias=bias, rope=False, num_heads=heads, num_kv_heads=heads)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True, config.decoder_ffn_dim, config.activation_function)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
        if config.tie_word_embeddings and not self.model.layout.tied:
            self.lm_head = ParallelLMHead(config.vocab_size, config.d_model)

    def convert_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors less the cross-attention's, the final norm by one name; zeros for Whisper's missing
        key biases; the sinusoidal table where the checkpoint has none (transformers' ForConditionalGeneration files
        leave it out)."""
        layout, table = self.model.layout, False
        final_norm = f"model.decoder.{layout.final_norm_name}."
        for name, tensor in weights:
            if ".encoder_attn" in name:
                continue
            if name.startswith(final_norm):
                name = "model.decoder.layer_norm." + name.removeprefix(final_norm)
            yield name, tensor
            table = table or name.endswith(".embed_positions.weight")
            if not layout.key_bias and name.endswith(".self_attn.k_proj.weight"):
                yield name.removesuffix("weight") + "bias", torch.zeros(tensor.shape[0])
        if layout.sinusoidal and not table:
            yield "model.wpe.weight", sinusoidal_table(*self.model.wpe.weight.shape)
