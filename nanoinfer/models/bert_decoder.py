"""BERT-style models run as decoders (transformers' causal LMs of `is_decoder=True` configs): BERT (BertLMHeadModel),
ERNIE, BigBird (full attention), RoBERTa and its namesakes (XLM-RoBERTa, CamemBERT, Data2Vec-Text), ELECTRA's
generator, RemBERT, BertGeneration's decoder, and the pre-LN ones (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL,
Megatron-BERT). Word + learned absolute position + token type 0 embeddings (none of the type in BertGeneration's;
ERNIE's task type 0 too where `use_task_id`), LayerNorm'd but in XLM-R-XL and Megatron-BERT, narrower than the hidden
size and projected to it in ELECTRA (`embedding_size`) and RemBERT (`input_embedding_size`). Then bert.py's attention
(biases, no rope, here causal and cached) and dense MLP in post-LN layers, x = LN(x + attn(x)), LN(x + mlp(x)), or
pre-LN ones, x + attn(LN(x)), x + mlp(LN(x)), with a final LayerNorm. Then the prediction head (dense, activation,
LayerNorm; BertGeneration has none) and the decoder to the vocabulary, with its bias, tied to the word embeddings
unless the config unties them (RemBERT's never are).

RoBERTa's layout counts positions from padding_idx + 1 and gives a pad token position padding_idx, as transformers'
`create_position_ids_from_input_ids` does for the tokens after its cache; within one prompt transformers also skips the
pad tokens before a token in counting its position, which the engine does not (a prompt's chunks and cached prefixes
do not see each other's tokens): prompts holding the pad id take other positions after it than transformers' prefill
gives them (its next decode step counts every token, as the engine does)."""
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import get_act
from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.bert import ENCODER_ATTENTION, BertModel
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, ResidualSum
from nanoinfer.models.llama import AttentionOptions, LlamaAttention


def check_config(config: PretrainedConfig) -> None:
    """What transformers runs otherwise than these causal decoders, refused by name: a config without `is_decoder`
    (its attention is then bidirectional), cross-attention, relative position embeddings."""
    if not getattr(config, "is_decoder", False):
        raise ValueError(f"is_decoder={getattr(config, 'is_decoder', None)!r} in {config_source(config)}: "
                         f"transformers runs {config.model_type} without it bidirectionally, not as a causal LM")
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"add_cross_attention=True in {config_source(config)}: cross-attention is not supported "
                         f"for {config.model_type}")
    position_type = getattr(config, "position_embedding_type", None)
    if position_type not in (None, "absolute"):
        raise ValueError(f"position_embedding_type={position_type!r} in {config_source(config)}: only 'absolute' "
                         f"positions are supported for {config.model_type}")


def frozen_table(rows: int, width: int) -> nn.Embedding:
    """A small table replicated on every rank (as GPT-2's wpe): no all-reduce of its own."""
    table = nn.Embedding(rows, width)
    table.weight.requires_grad_(False)
    return table


class DecoderEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig, width: int, token_types: bool, norm: bool, roberta_positions: bool,
                 absolute_positions: bool):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, width)
        self.position_embeddings = (frozen_table(config.max_position_embeddings, width) if absolute_positions
                                    else None)
        self.token_type_embeddings = frozen_table(config.type_vocab_size, width) if token_types else None
        self.task_type_embeddings = (frozen_table(config.task_type_vocab_size, width)
                                     if getattr(config, "use_task_id", False) else None)
        self.norm = LayerNorm(width, config.layer_norm_eps) if norm else None
        # BigBird's `rescale_embeddings`: the word embeddings times sqrt(hidden) after the lookup
        self.word_scale = config.hidden_size ** 0.5 if getattr(config, "rescale_embeddings", False) else None
        if roberta_positions and config.pad_token_id is None:
            raise ValueError(f"pad_token_id=None in {config_source(config)}: {config.model_type}'s positions count "
                             f"from it")
        self.padding_idx = config.pad_token_id if roberta_positions else None

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows of position_embeddings: the positions themselves, or RoBERTa's padding_idx + 1 + position
        (padding_idx for a pad token)."""
        if self.padding_idx is None:
            return positions
        return torch.where(input_ids == self.padding_idx, self.padding_idx, positions + self.padding_idx + 1)

    def words(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The word embeddings, scaled where BigBird scales them."""
        x = self.word_embeddings(input_ids)
        return x if self.word_scale is None else x * self.word_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """positions: each token's in its sequence; None, in an encoder pass (see LLM.embed), adds none."""
        x = self.words(input_ids)
        for types in (self.token_type_embeddings, self.task_type_embeddings):  # every token's type 0
            if types is not None:
                x = x + types.weight[0]
        if positions is not None and self.position_embeddings is not None:
            x = x + self.position_embeddings(self.position_ids(input_ids, positions))
        return x if self.norm is None else self.norm(x)


class BertDecoder(nn.Module):
    def __init__(self, config: PretrainedConfig, embeddings: DecoderEmbeddings, width: int, pre_norm: bool,
                 make_layer: Callable[[], nn.Module]):
        super().__init__()
        self.embeddings = embeddings
        self.embeddings_project = (ReplicatedLinear(width, config.hidden_size, bias=True)
                                   if width != config.hidden_size else None)
        self.layers = nn.ModuleList(make_layer() for _ in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps) if pre_norm else ResidualSum()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        x, residual = self.embeddings(input_ids, positions), None
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class PredictionHead(nn.Module):
    """dense, activation, LayerNorm, before the decoder. Replicated: it runs on the few rows that are sampled."""

    def __init__(self, config: PretrainedConfig, width: int, activation: str):
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, width, bias=True)
        self.act = get_act(activation)
        self.norm = LayerNorm(width, config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


# transformers' names of a layer's tensors: the attention's and the MLP's, then the post-LN layers' LayerNorms.
LAYER_NAMES = {".attention.self.": ".self_attn.", ".attention.output.dense.": ".self_attn.o_proj.",
               ".intermediate.dense.": ".mlp.fc1.", ".output.dense.": ".mlp.fc2."}
POST_NORM_NAMES = {".attention.output.LayerNorm.": ".input_layernorm.",
                   ".output.LayerNorm.": ".post_attention_layernorm."}
# The heads' names: BERT's (ERNIE's, BigBird's, RoCBert's, Megatron-BERT's), RoBERTa's (its namesakes', the pre-LN
# RoBERTas', X-MOD's).
BERT_HEAD_NAMES = {"^cls.predictions.transform.dense.": "head.dense.",
                   "^cls.predictions.transform.LayerNorm.": "head.norm.",
                   "^cls.predictions.decoder.": "decoder.", "^cls.predictions.bias": "decoder.bias"}
ROBERTA_HEAD_NAMES = {"^lm_head.dense.": "head.dense.", "^lm_head.layer_norm.": "head.norm.",
                      "^lm_head.decoder.": "decoder.", "^lm_head.bias": "decoder.bias"}


def decoder_names(prefix: str) -> dict[str, str]:
    """The decoder's embeddings and layers under transformers' `prefix` (bert, roberta, ...)."""
    return {f"^{prefix}.embeddings.LayerNorm.": "model.embeddings.norm.", f"^{prefix}.": "model.",
            "^model.encoder.layer.": "model.layers.", **LAYER_NAMES}


class BertLMHeadModel(nn.Module):
    """BERT's: post-LN, the head's activation the config's `hidden_act`. Subclasses flip what their family does
    otherwise."""

    pre_norm = False
    embeddings_norm = True
    roberta_positions = False
    head_activation: str | None = None  # None: the config's hidden_act; RoBERTa's and ELECTRA's head: "gelu"
    prediction_head = True  # BertGeneration's decoder alone
    ties = True  # RemBERT's decoder never shares the word embeddings (transformers ties none of its weights)
    embeddings_class: type[DecoderEmbeddings] = DecoderEmbeddings
    absolute_positions = True  # RoFormer's rotate queries and keys instead
    packed_modules_mapping = BertModel.packed_modules_mapping
    weight_name_substitutions = {**decoder_names("bert"), **POST_NORM_NAMES, **BERT_HEAD_NAMES}
    ignored_weight_suffixes = ("embeddings.position_ids",)  # old files keep the buffer

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_config(config)
        width, head_width = self.widths(config)
        token_types = getattr(config, "type_vocab_size", None) is not None
        embeddings = self.embeddings_class(config, width, token_types, self.embeddings_norm, self.roberta_positions,
                                           self.absolute_positions)
        self.model = BertDecoder(config, embeddings, width, self.pre_norm, partial(self.make_layer, config))
        self.head = (PredictionHead(config, head_width, self.head_activation or config.hidden_act)
                     if self.prediction_head else None)
        self.decoder = ParallelLMHead(config.vocab_size, head_width, bias=True)
        if self.ties and config.tie_word_embeddings:
            self.decoder.weight = self.model.embeddings.word_embeddings.weight

    @staticmethod
    def widths(config: PretrainedConfig) -> tuple[int, int]:
        """The embeddings' width and the prediction head's: the hidden size, or ELECTRA's `embedding_size` both."""
        width = getattr(config, "embedding_size", config.hidden_size)
        return width, width

    @staticmethod
    def attention_options(config: PretrainedConfig) -> AttentionOptions:
        return ENCODER_ATTENTION

    def make_layer(self, config: PretrainedConfig) -> nn.Module:
        residual = "sequential" if self.pre_norm else "post-norm"
        return LayerNormDecoderLayer(LlamaAttention(config, self.attention_options(config)),
                                     DenseMLP(config, bias=True), config.hidden_size, config.layer_norm_eps, residual)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        """The last layer's hidden states (pre-LN: after the final LayerNorm), [tokens, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.decoder(hidden_states if self.head is None else self.head(hidden_states))


class ErnieForCausalLM(BertLMHeadModel):
    weight_name_substitutions = {**decoder_names("ernie"), **POST_NORM_NAMES, **BERT_HEAD_NAMES}


class BertGenerationDecoder(BertLMHeadModel):
    prediction_head = False
    weight_name_substitutions = {**decoder_names("bert"), **POST_NORM_NAMES, "^lm_head.decoder.": "decoder.",
                                 "^lm_head.bias": "decoder.bias"}


class ElectraForCausalLM(BertLMHeadModel):
    head_activation = "gelu"
    weight_name_substitutions = {**decoder_names("electra"), **POST_NORM_NAMES,
                                 "^generator_predictions.dense.": "head.dense.",
                                 "^generator_predictions.LayerNorm.": "head.norm.", "^generator_lm_head.": "decoder."}


class RobertaForCausalLM(BertLMHeadModel):
    """RoBERTa's, XLM-RoBERTa's, CamemBERT's: positions from padding_idx + 1, the head's activation GeLU."""

    roberta_positions = True
    head_activation = "gelu"
    weight_name_substitutions = {**decoder_names("roberta"), **POST_NORM_NAMES, **ROBERTA_HEAD_NAMES}


class Data2VecTextForCausalLM(RobertaForCausalLM):
    weight_name_substitutions = {**decoder_names("data2vec_text"), **POST_NORM_NAMES, **ROBERTA_HEAD_NAMES}


class RobertaPreLayerNormForCausalLM(RobertaForCausalLM):
    pre_norm = True
    weight_name_substitutions = {"^roberta_prelayernorm.LayerNorm.": "model.norm.",
                                 **decoder_names("roberta_prelayernorm"), ".attention.LayerNorm.": ".input_layernorm.",
                                 ".intermediate.LayerNorm.": ".post_attention_layernorm.", **ROBERTA_HEAD_NAMES}


class XLMRobertaXLForCausalLM(RobertaForCausalLM):
    """Pre-LN, its embeddings without a LayerNorm."""

    pre_norm = True
    embeddings_norm = False
    weight_name_substitutions = {"^roberta.encoder.LayerNorm.": "model.norm.", **decoder_names("roberta"),
                                 ".attention.self_attn_layer_norm.": ".input_layernorm.",
                                 ".LayerNorm.": ".post_attention_layernorm.", **ROBERTA_HEAD_NAMES}


class MegatronBertForCausalLM(BertLMHeadModel):
    """Pre-LN, its embeddings without a LayerNorm."""

    pre_norm = True
    embeddings_norm = False
    weight_name_substitutions = {"^bert.encoder.ln.": "model.norm.", **decoder_names("bert"),
                                 ".attention.ln.": ".input_layernorm.", ".ln.": ".post_attention_layernorm.",
                                 **BERT_HEAD_NAMES}


class BigBirdForCausalLM(BertLMHeadModel):
    """BERT's, with full attention: as a decoder transformers switches its block-sparse attention to full whenever it
    caches (and for prompts shorter than its sparse pattern); q/k/v biases where `use_bias`, the word embeddings
    scaled where `rescale_embeddings`. Its files hold a pooler, unused here."""

    ignored_weight_prefixes = ("bert.pooler.",)

    @staticmethod
    def attention_options(config: PretrainedConfig) -> AttentionOptions:
        return replace(ENCODER_ATTENTION, qkv_bias=config.use_bias)


class RemBertForCausalLM(BertLMHeadModel):
    """BERT's layers between embeddings `input_embedding_size` wide (projected in) and a head `output_embedding_size`
    wide, never tied."""

    ties = False
    weight_name_substitutions = {"^rembert.encoder.embedding_hidden_mapping_in.": "model.embeddings_project.",
                                 **decoder_names("rembert"), **POST_NORM_NAMES,
                                 "^cls.predictions.LayerNorm.": "head.norm.", "^cls.predictions.": "head.",
                                 "^head.decoder.": "decoder."}

    @staticmethod
    def widths(config: PretrainedConfig) -> tuple[int, int]:
        return config.input_embedding_size, config.output_embedding_size


class XmodLayer(LayerNormDecoderLayer):
    """X-MOD's post-LN layer: after the MLP's LayerNorm'd sum, x + adapter(x) through the same LayerNorm, the adapter
    (dense, `hidden_act`, dense) the default language's."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(LlamaAttention(config, options), DenseMLP(config, bias=True), config.hidden_size,
                         config.layer_norm_eps, "post-norm")
        self.adapter = DenseMLP(config, True, config.hidden_size // config.adapter_reduction_factor)

    def forward_post_norm(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata
                          ) -> torch.Tensor:
        x = super().forward_post_norm(positions, x, meta)
        x, _ = self.post_attention_layernorm(self.adapter(x), x)
        return x


# X-MOD's adapter settings, as its checkpoints (and transformers' defaults) have them: the only ones run here.
XMOD_ADAPTER = {"pre_norm": False, "adapter_layer_norm": False, "adapter_reuse_layer_norm": True,
                "ln_before_adapter": True}


class XmodForCausalLM(RobertaForCausalLM):
    """RoBERTa's, each layer with the adapter of the config's `default_language` (as transformers, given no
    `lang_ids`); the other languages' adapters are not loaded."""

    weight_name_substitutions = {**RobertaForCausalLM.weight_name_substitutions,
                                 ".output.adapter.dense1.": ".adapter.fc1.", ".output.adapter.dense2.": ".adapter.fc2."}

    def __init__(self, config: PretrainedConfig):
        for name, value in XMOD_ADAPTER.items():
            if getattr(config, name) != value:
                raise ValueError(f"{name}={getattr(config, name)!r} in {config_source(config)}: X-MOD runs here with "
                                 f"{name}={value!r} alone")
        if config.default_language not in config.languages:
            raise ValueError(f"default_language={config.default_language!r} in {config_source(config)}: X-MOD runs "
                             f"the adapters of its default language, one of {config.languages}")
        super().__init__(config)
        self.language = config.default_language

    def make_layer(self, config: PretrainedConfig) -> nn.Module:
        return XmodLayer(config, self.attention_options(config))

    def convert_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The default language's adapters as the layers' `adapter`; the other languages' dropped."""
        mine = f".adapter_modules.{self.language}."
        for name, tensor in weights:
            if ".adapter_modules." not in name:
                yield name, tensor
            elif mine in name:
                yield name.replace(mine, ".adapter."), tensor


class RoCBertEmbeddings(DecoderEmbeddings):
    """RoCBert's, where `concat_input`: the word embeddings joined by the shape and pronunciation embeddings of id 0
    (transformers' ids without `input_shape_ids` / `input_pronunciation_ids`), mapped back to the hidden size
    (`map_inputs_layer`); without it, BERT's (transformers adds neither then)."""

    def __init__(self, config: PretrainedConfig, width: int, token_types: bool, norm: bool, roberta_positions: bool,
                 absolute_positions: bool):
        super().__init__(config, width, token_types, norm, roberta_positions, absolute_positions)
        self.shape_embed = (frozen_table(config.shape_vocab_size, config.shape_embed_dim) if config.enable_shape
                            else None)
        self.pronunciation_embed = (frozen_table(config.pronunciation_vocab_size, config.pronunciation_embed_dim)
                                    if config.enable_pronunciation else None)
        joined = width + sum(t.embedding_dim for t in self.joined_tables())
        self.map_inputs_layer = ReplicatedLinear(joined, width, bias=True) if config.concat_input else None

    def joined_tables(self) -> list[nn.Embedding]:
        return [t for t in (self.shape_embed, self.pronunciation_embed) if t is not None]

    def words(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().words(input_ids)
        if self.map_inputs_layer is None:
            return x
        return self.map_inputs_layer(torch.cat([x, *(t.weight[0].expand(len(x), -1) for t in self.joined_tables())],
                                               -1))


class RoCBertForCausalLM(BertLMHeadModel):
    embeddings_class = RoCBertEmbeddings
    weight_name_substitutions = {**decoder_names("roc_bert"), **POST_NORM_NAMES, **BERT_HEAD_NAMES}


class RoFormerForCausalLM(BertLMHeadModel):
    """BERT's without position embeddings: rope over each head's queries and keys, on interleaved pairs at base 10000
    (transformers' sinusoid table, `encoder.embed_positions`, computed here, not read from the checkpoint), the
    embeddings `embedding_size` wide and projected where narrower."""

    absolute_positions = False
    weight_name_substitutions = {**decoder_names("roformer"), **POST_NORM_NAMES, **BERT_HEAD_NAMES}
    ignored_weight_suffixes = ("encoder.embed_positions.weight",)

    def __init__(self, config: PretrainedConfig):
        if config.rotary_value:
            raise ValueError(f"rotary_value=True in {config_source(config)}: only queries and keys are rotated here")
        super().__init__(config)

    @staticmethod
    def attention_options(config: PretrainedConfig) -> AttentionOptions:
        return replace(ENCODER_ATTENTION, rope=True, rope_interleaved=True, rope_theta=10_000.0, rope_fp64=True)
