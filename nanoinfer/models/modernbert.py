"""ModernBERT encoders, as `ModernBertModel` (LLM.embed: the final-norm hidden states, pooled) and
`ModernBertForSequenceClassification` (LLM.classify, LLM.score: a head on the pooled states), and ModernBERT's decoder,
`ModernBertDecoderForCausalLM`. Token embeddings and their LayerNorm (no position table: rotary), then pre-norm
layers, x += attn(norm(x)) (the first layer's norm an identity) and x += mlp(norm(x)), and a final LayerNorm;
LayerNorms with or without bias (`norm_bias`). The encoder's attention (fused Wqkv, biases as `attention_bias`) is
bidirectional and caches nothing: global on `full_attention` layers, local on `sliding_attention` ones (every token
sees those within local_attention // 2 positions on either side); the decoder's (q, k and v apart) is causal, its
local layers seeing the last local_attention // 2 positions. Each layer type has its own rope theta. The MLP is a
GeGLU: Wi holds the activated half, then the gate."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import get_act
from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP, OptionsFactory

LAYER_TYPES = ("full_attention", "sliding_attention")
CLASSIFIER_POOLINGS = ("cls", "mean")


def check_layer_types(config: PretrainedConfig) -> None:
    """Layer types this implementation knows, refused by name otherwise (transformers 5 derives `layer_types` from
    older configs' `global_attn_every_n_layers`)."""
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} in the model config: ModernBERT's are {list(LAYER_TYPES)}")


def check_config(config: PretrainedConfig) -> None:
    """The layer types and a classifier pooling this implementation knows, refused by name otherwise."""
    check_layer_types(config)
    if config.classifier_pooling not in CLASSIFIER_POOLINGS:
        raise ValueError(f"classifier_pooling={config.classifier_pooling!r} in the model config: ModernBERT's is one "
                         f"of {list(CLASSIFIER_POOLINGS)}")


def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    """The layer type's rope settings; a local layer's window of local_attention // 2 keys on either side of the
    query (transformers: |i - j| <= local_attention // 2), which Attention's encoder-only window counts with the
    query's own position: local_attention // 2 + 1."""
    layer_type = config.layer_types[layer_idx]
    window = config.local_attention // 2 + 1 if layer_type == "sliding_attention" else None
    return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, sliding_window=window,
                            rope_layer_type=layer_type, encoder_only=True)


def decoder_attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    """The decoder's: causal, a local layer seeing the last local_attention // 2 positions, its own included
    (transformers' `sliding_window`, which it derives so)."""
    layer_type = config.layer_types[layer_idx]
    window = config.local_attention // 2 if layer_type == "sliding_attention" else None
    return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, sliding_window=window,
                            rope_layer_type=layer_type)


class ModernBertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, options: AttentionOptions):
        super().__init__()
        norm = lambda: LayerNorm(config.hidden_size, config.norm_eps, config.norm_bias)  # noqa: E731
        # The embeddings' norm precedes the first layer: its attention norm is an identity.
        self.attn_norm = nn.Identity() if layer_idx == 0 else norm()
        self.attn = LlamaAttention(config, options)
        self.mlp_norm = norm()
        self.mlp = LlamaMLP(config, hidden_act=config.hidden_activation, bias=config.mlp_bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(positions, self.attn_norm(x), meta)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEncoder(nn.Module):
    """The encoder, or with the decoder's attention options the decoder, to the final norm."""

    def __init__(self, config: PretrainedConfig, options: OptionsFactory = attention_options):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embeddings.norm = LayerNorm(config.hidden_size, config.norm_eps, config.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, options(config, i))
                                    for i in range(config.num_hidden_layers))
        self.final_norm = LayerNorm(config.hidden_size, config.norm_eps, config.norm_bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.final_norm(x)


class ModernBertModel(nn.Module):
    """The encoder alone (LLM.embed): its final-norm hidden states."""

    # Fused q/k/v and input/gate load whole, each rank taking its rows of every stacked part (as Phi-3's).
    packed_modules_mapping = {}
    # transformers' names, in this order: a classifier's encoder under `model.`, a bare encoder's without.
    weight_name_substitutions = {
        "^embeddings.": "model.embeddings.",
        "^layers.": "model.layers.",
        "^final_norm.": "model.final_norm.",
        ".attn.Wqkv.": ".attn.qkv_proj.",
        ".attn.Wo.": ".attn.o_proj.",
        ".mlp.Wi.": ".mlp.gate_up_proj.",
        ".mlp.Wo.": ".mlp.down_proj.",
    }

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_config(config)
        self.model = ModernBertEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final-norm hidden states, [tokens, hidden]."""
        return self.model(input_ids, positions, meta)


class ModernBertForSequenceClassification(ModernBertModel):
    """transformers' head on the pooled states (`classifier_pooling`: the [CLS] token's or the mean of every
    token's): `head` (dense, the `classifier_activation`, LayerNorm), then `classifier` to num_labels."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.classifier_pooling = config.classifier_pooling  # see ModelRunner.classify
        # Replicated, as classification.py's score: rank 0 applies it alone, to a few rows.
        self.head = ModernBertPredictionHead(config)
        self.classifier = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, num_labels] from the rows' pooled hidden states."""
        return self.classifier(self.head(hidden_states))


class ModernBertPredictionHead(nn.Module):
    """dense, the `classifier_activation`, LayerNorm: before the classifier, or the decoder's LM head. Replicated:
    it runs on the few rows that are scored."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.act = get_act(config.classifier_activation)
        self.norm = LayerNorm(config.hidden_size, config.norm_eps, config.norm_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertDecoderForCausalLM(nn.Module):
    """The decoder's final-norm hidden states through the prediction head (`lm_head`), then `decoder`, the
    vocabulary projection with a bias where `decoder_bias`, tied to the token embeddings where the config says."""

    packed_modules_mapping = {name: value for name, value in LlamaForCausalLM.packed_modules_mapping.items()
                              if name in ("q_proj", "k_proj", "v_proj")}
    weight_name_substitutions = {k: v for k, v in ModernBertModel.weight_name_substitutions.items()
                                 if k.startswith((".attn.Wo", ".mlp."))}

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_layer_types(config)
        window = config.local_attention
        if "sliding_attention" in config.layer_types and not (isinstance(window, int) and window >= 2):
            raise ValueError(f"local_attention={window!r} in the model config: its sliding_attention layers see "
                             f"local_attention // 2 positions, at least one")
        self.model = ModernBertEncoder(config, decoder_attention_options)
        self.lm_head = ModernBertPredictionHead(config)
        self.decoder = ParallelLMHead(config.vocab_size, config.hidden_size, config.decoder_bias)
        if config.tie_word_embeddings:
            self.decoder.weight = self.model.embeddings.tok_embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        """The final-norm hidden states, [tokens, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.decoder(self.lm_head(hidden_states))
