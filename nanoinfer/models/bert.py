"""Encoder-only models of the BERT family: BERT, RoBERTa and XLM-RoBERTa, as `*Model` (LLM.embed: the last hidden
states, pooled) and `*ForSequenceClassification` (LLM.classify, LLM.score: a head on the first token, [CLS] / <s>).
Word + absolute position + token-type embeddings and their LayerNorm, then post-LN layers, x = LN(x + attn(x)) and
x = LN(x + mlp(x)), whose attention (biases, no rope) is bidirectional and caches nothing. RoBERTa's positions start
at padding_idx + 1. A token's type (BERT's sentence A or B of a scored pair) rides in the high bits of its id
(with_token_types), so the engine hands the model token ids and positions only, as for every other family."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.layernorm_decoder import DenseMLP
from nanoinfer.models.llama import AttentionOptions, LlamaAttention

TOKEN_TYPE_SHIFT = 30  # token ids stay below 2**30; a token's type sits above them (vLLM's layout)
TOKEN_ID_MASK = (1 << TOKEN_TYPE_SHIFT) - 1
# q/k/v and output biases, no position encoding in the attention; causal or not is the step's (AttentionMetadata).
ENCODER_ATTENTION = AttentionOptions(qkv_bias=True, o_bias=True, rope=False)


def has_token_types(config: PretrainedConfig) -> bool:
    """Whether the model tells a pair's two sentences apart by token type: BERT's 2 types; RoBERTa's 1 does not."""
    return getattr(config, "type_vocab_size", 1) > 1


def with_token_types(token_ids: list[int], token_type_ids: list[int]) -> list[int]:
    """The model's input ids: each token id with its type in the bits from TOKEN_TYPE_SHIFT up."""
    return [t | (tt << TOKEN_TYPE_SHIFT) for t, tt in zip(token_ids, token_type_ids, strict=True)]


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from the checkpoint's
    training (transformers 5 ignores `position_embedding_type` too)."""
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"position_embedding_type={position_type!r} in the model config: only 'absolute' "
                         f"positions are supported for {config.model_type}")
    for name in ("is_decoder", "add_cross_attention"):
        if getattr(config, name, False):
            raise ValueError(f"{name}=True in the model config: not supported for {config.model_type}")


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Replicated on every rank (as GPT-2's wpe): small, and no all-reduce of their own.
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        for table in (self.position_embeddings, self.token_type_embeddings):
            table.weight.requires_grad_(False)
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows of position_embeddings: BERT's are the positions themselves."""
        return positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids: with their token types (see with_token_types); positions: each token's in its prompt."""
        token_types, input_ids = input_ids >> TOKEN_TYPE_SHIFT, input_ids & TOKEN_ID_MASK
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
        return self.norm(x + self.position_embeddings(self.position_ids(input_ids, positions)))


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        if config.pad_token_id is None:
            raise ValueError(f"pad_token_id=None in the model config: {config.model_type}'s positions count from it")
        self.padding_idx = config.pad_token_id

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """transformers' rule: padding_idx + the number of non-pad tokens up to this one in its prompt (the first
        token's is padding_idx + 1); a pad token's is padding_idx. positions tell where each prompt starts."""
        not_pad = (input_ids != self.padding_idx).long()
        counts = not_pad.cumsum(0)
        first = torch.arange(len(input_ids), device=input_ids.device) - positions  # its prompt's first token
        return (counts - counts[first] + not_pad[first]) * not_pad + self.padding_idx


class BertLayer(nn.Module):
    """Post-LN: x = LN(x + attn(x)), then LN(x + mlp(x)); the MLP dense with the config's `hidden_act`."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.self_attn = LlamaAttention(config, ENCODER_ATTENTION)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.mlp = DenseMLP(config, bias=True)
        self.post_mlp_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.post_attention_layernorm(self.self_attn(None, x, meta) + x)
        return self.post_mlp_layernorm(self.mlp(x) + x)


class BertEncoder(nn.Module):
    embeddings_class: type[BertEmbeddings] = BertEmbeddings

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embeddings = self.embeddings_class(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, meta)
        return x


class RobertaEncoder(BertEncoder):
    embeddings_class = RobertaEmbeddings


class BertModel(nn.Module):
    """The encoder alone (LLM.embed): its last hidden states, no final norm."""

    encoder_class: type[BertEncoder] = BertEncoder
    packed_modules_mapping = {"query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")}
    # transformers' names, in this order: a classifier's encoder under `bert.` / `roberta.`, a bare encoder's without.
    weight_name_substitutions = {
        "^bert.": "",
        "^roberta.": "",
        "^embeddings.LayerNorm.": "model.embeddings.norm.",
        "^embeddings.": "model.embeddings.",
        "^encoder.layer.": "model.layers.",
        ".attention.self.": ".self_attn.",
        ".attention.output.dense.": ".self_attn.o_proj.",
        ".attention.output.LayerNorm.": ".post_attention_layernorm.",
        ".intermediate.dense.": ".mlp.fc1.",
        ".output.dense.": ".mlp.fc2.",
        ".output.LayerNorm.": ".post_mlp_layernorm.",
    }
    # BERT's pooler, which transformers' *Model checkpoints hold, serves its classifier only; old files keep the
    # position ids buffer.
    ignored_weight_prefixes = ("pooler.", "bert.pooler.", "roberta.pooler.")
    ignored_weight_suffixes = ("embeddings.position_ids",)

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_config(config)
        self.model = self.encoder_class(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The last layer's hidden states, [tokens, hidden]."""
        return self.model(input_ids, positions, meta)


class RobertaModel(BertModel):
    encoder_class = RobertaEncoder


class BertForSequenceClassification(BertModel):
    """transformers' head on the [CLS] token: the pooler (dense + tanh), then `classifier` to num_labels."""

    ignored_weight_prefixes = ()
    classifier_pooling = "cls"  # see ModelRunner.classify

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        # Replicated, as classification.py's score: rank 0 applies it alone, to a few rows.
        self.pooler = nn.Module()
        self.pooler.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)
        self.classifier = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, num_labels] from the rows' [CLS] hidden states."""
        return self.classifier(torch.tanh(self.pooler.dense(hidden_states)))


class RobertaForSequenceClassification(RobertaModel):
    """transformers' RobertaClassificationHead on the <s> token: `classifier.dense` + tanh, then
    `classifier.out_proj` to num_labels."""

    classifier_pooling = "cls"

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.classifier = nn.Module()
        self.classifier.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)
        self.classifier.out_proj = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, num_labels] from the rows' <s> hidden states."""
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(hidden_states)))
