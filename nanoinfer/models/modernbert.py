"""ModernBERT encoders, as `ModernBertModel` (LLM.embed: the final-norm hidden states, pooled) and
`ModernBertForSequenceClassification` (LLM.classify, LLM.score: a head on the pooled states). Token embeddings and
their LayerNorm (no position table: rotary), then pre-norm layers, x += attn(norm(x)) (the first layer's norm an
identity) and x += mlp(norm(x)), and a final LayerNorm; LayerNorms with or without bias (`norm_bias`). The attention
(fused Wqkv, biases as `attention_bias`) is bidirectional and caches nothing: global on `full_attention` layers, local
on `sliding_attention` ones (every token sees those within local_attention // 2 positions on either side), each layer
type with its own rope theta. The MLP is a GeGLU: Wi holds the activated half, then the gate."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import get_act
from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP

LAYER_TYPES = ("full_attention", "sliding_attention")
CLASSIFIER_POOLINGS = ("cls", "mean")


def check_config(config: PretrainedConfig) -> None:
    """Layer types and a classifier pooling this implementation knows, refused by name otherwise (transformers 5
    derives `layer_types` from older configs' `global_attn_every_n_layers`)."""
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} in the model config: ModernBERT's are {list(LAYER_TYPES)}")
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


class ModernBertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        norm = lambda: LayerNorm(config.hidden_size, config.norm_eps, config.norm_bias)  # noqa: E731
        # The embeddings' norm precedes the first layer: its attention norm is an identity.
        self.attn_norm = nn.Identity() if layer_idx == 0 else norm()
        self.attn = LlamaAttention(config, attention_options(config, layer_idx))
        self.mlp_norm = norm()
        self.mlp = LlamaMLP(config, hidden_act=config.hidden_activation, bias=config.mlp_bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(positions, self.attn_norm(x), meta)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embeddings.norm = LayerNorm(config.hidden_size, config.norm_eps, config.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_hidden_layers))
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
        self.head = nn.Module()
        self.head.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.head.act = get_act(config.classifier_activation)
        self.head.norm = LayerNorm(config.hidden_size, config.norm_eps, config.norm_bias)
        self.classifier = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, num_labels] from the rows' pooled hidden states."""
        return self.classifier(self.head.norm(self.head.act(self.head.dense(hidden_states))))
