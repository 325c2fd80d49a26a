"""The decoder of hybrid models whose layers mix tokens either by attention or by a recurrent mixer (Mamba2, LFM2's
short convolution, Gated DeltaNet, KDA, lightning attention), by the config's layer types, each followed by an MLP:
LFM2, Bamba, Granite 4.0-H, Kimi Linear, Ling's hybrid, MiniMax; Qwen3-Next's layers too."""
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.recurrent import RecurrentBatch
from nanoinfer.models.config_checks import check_each_in, config_source
from nanoinfer.models.llama import LlamaForCausalLM
from nanoinfer.utils.dist import tp_size

# (config, layer index) -> that layer's token mixer: attention, forward(positions, x, meta), or a recurrent mixer,
# forward(x, batch) (told apart by `is_attention_layer`); and its MLP.
LayerFactory = Callable[[PretrainedConfig, int], nn.Module]


LINEAR_ATTENTION_LAYER_TYPES = ("linear_attention", "full_attention")


def check_layer_config(config: PretrainedConfig, heads: str | None = None, silu: bool = False,
                       layer_types: tuple[str, ...] = LINEAR_ATTENTION_LAYER_TYPES) -> str:
    """Refuses by name what a linear-attention hybrid cannot run rather than run it differently from transformers: a
    layer type beyond `layer_types`, a `hidden_act` other than SiLU (silu: the layers apply it), a head count (the
    config's attribute `heads`) that tensor parallelism cannot split. Returns where the config comes from."""
    where = config_source(config)
    check_each_in(config, "layer_types", layer_types)
    if silu and config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} in {where} is not supported; only 'silu' is implemented")
    if heads is not None and getattr(config, heads) % tp_size():
        raise ValueError(f"{heads}={getattr(config, heads)} in {where} does not split over "
                         f"tensor_parallel_size={tp_size()}")
    return where


def mixers_named_self_attn(config: PretrainedConfig, name: str = "self_attn") -> dict[str, str]:
    """Weight-name substitutions for checkpoints that give every layer's mixer one name (Kimi Linear's and MiniMax's
    `self_attn`, Ling's `attention`): the linear-attention layers' to HybridDecoderLayer's `mixer`."""
    return {f"^model.layers.{i}.{name}.": f"model.layers.{i}.mixer."
            for i, layer_type in enumerate(config.layer_types) if layer_type == "linear_attention"}


class HybridDecoderLayer(nn.Module):
    """Pre-norm: x + mixer(norm(x)), then + mlp(norm(.)) (mlp None: no second sublayer, no second norm); each
    sublayer's output times residual_multiplier (Granite's; None: 1). norm: the norms' class (Qwen3-Next's scale by
    1 + weight: GemmaRMSNorm)."""

    def __init__(self, config: PretrainedConfig, mixer: nn.Module, is_attention_layer: bool, mlp: nn.Module | None,
                 eps: float, residual_multiplier: float | None = None, norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.is_attention_layer = is_attention_layer
        if is_attention_layer:
            self.self_attn = mixer
        else:
            self.mixer = mixer
        self.mlp = mlp
        self.input_layernorm = norm(config.hidden_size, eps)
        if mlp is not None:
            self.post_attention_layernorm = norm(config.hidden_size, eps)
        self.residual_multiplier = residual_multiplier

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier is None else x * self.residual_multiplier

    def mix(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch
            ) -> torch.Tensor:
        """The token mixer's output for the normed x (Falcon-H1's layers run two side by side)."""
        return self.self_attn(positions, x, meta) if self.is_attention_layer else self.mixer(x, batch)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, batch: RecurrentBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mix(positions, x, meta, batch)
        if self.mlp is None:
            return self.scaled(x), residual
        # The next norm adds its input to the residual stream: scaled first, as transformers' `residual + h * m`.
        x, residual = self.post_attention_layernorm(self.scaled(x), residual)
        return self.scaled(self.mlp(x)), residual


class HybridModel(nn.Module):
    def __init__(self, config: PretrainedConfig, make_layer: LayerFactory, norm: RMSNorm,
                 embedding_multiplier: float | None = None, embed_tokens: nn.Module | None = None):
        """embed_tokens: the input embedding where it is not a plain VocabParallelEmbedding (Inkling's normed one)."""
        super().__init__()
        self.embed_tokens = embed_tokens or VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm
        self.embedding_multiplier = embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        batch = RecurrentBatch.from_metadata(meta)
        x, residual = self.embed_tokens(input_ids), None
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, batch)
        # residual None: layers that pass on no residual stream (MiniMax's).
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class HybridForCausalLM(nn.Module):
    """A family sets make_layer and the checkpoint's names (packed_modules_mapping, weight_name_substitutions), and
    model_class where its decoder loop is not HybridModel's (Inkling-2's block attention residuals)."""
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    model_class = HybridModel

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def make_final_norm(self, config: PretrainedConfig, eps: float) -> RMSNorm:
        """The norm after the last layer, rounding as the family's transformers model does."""
        return RMSNorm(config.hidden_size, eps)

    def make_embedding(self, config: PretrainedConfig) -> nn.Module | None:
        """The input embedding where it is not HybridModel's plain one, else None."""
        return None

    def __init__(self, config: PretrainedConfig, eps: float, embedding_multiplier: float | None = None,
                 logits_scaling: float | None = None, logit_softcap: float | None = None):
        """logits_scaling: the logits' divisor (Granite's, Inkling's); logit_softcap: cap * tanh(logits / cap)
        (Inkling-2's)."""
        super().__init__()
        self.model = self.model_class(config, self.make_layer, self.make_final_norm(config, eps),
                                      embedding_multiplier, self.make_embedding(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_scaling, self.logit_softcap = logits_scaling, logit_softcap

    forward = LlamaForCausalLM.forward

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        if logits is None:
            return None
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        return logits if self.logit_softcap is None else torch.tanh(logits / self.logit_softcap) * self.logit_softcap
