"""GPT-2: learned absolute position embeddings (`wpe`), pre-norm LayerNorms with biases, biases everywhere, the q/k/v
projection stored fused (`c_attn`) and every projection stored as transformers' Conv1D holds it ([in, out], transposed
here on load), a dense "gelu_new" MLP, a tied LM head."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, LayerNormModel, Residual
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, MLPFactory, OptionsFactory


class Conv1DWeightLoader:
    """Mixin for a linear layer whose checkpoint weight is a Conv1D's, [in, out]: transposed before the layer's own
    weight_loader takes its rank's slice."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is not None:  # a part of c_attn that the layer's own loader split off, transposed already
            super().weight_loader(param, loaded, shard_id)
            return
        super().weight_loader(param, loaded[...].t() if loaded.dim() == 2 else loaded)


class Conv1DQKVLinear(Conv1DWeightLoader, QKVParallelLinear):
    pass


class Conv1DColumnLinear(Conv1DWeightLoader, ColumnParallelLinear):
    pass


class Conv1DRowLinear(Conv1DWeightLoader, RowParallelLinear):
    pass


class GPT2Attention(LlamaAttention):
    qkv_class = Conv1DQKVLinear
    o_proj_class = Conv1DRowLinear


class GPT2MLP(DenseMLP):
    fc1_class = Conv1DColumnLinear
    fc2_class = Conv1DRowLinear


class GPT2Block(LayerNormDecoderLayer):
    residual: Residual = "sequential"  # OpenAI GPT's layers are post-norm

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(GPT2Attention(config, options), mlp, config.hidden_size, config.layer_norm_epsilon,
                         self.residual)


def biased_attention(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    """Attention with biases on every projection, no rope, the default 1/sqrt(head_dim) scale: the attention of
    GPT-2's descendants that have no scale options (BioGPT, CTRL, OpenAI GPT)."""
    return AttentionOptions(qkv_bias=True, o_bias=True, rope=False)


class GPT2Model(LayerNormModel):
    decoder_layer = GPT2Block
    position_offset = 0  # OPT's table holds 2 rows before position 0's (its padding's, once)

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.wpe = self.position_embedding(config)
        self.embed_scale = self.embedding_scale(config)

    @staticmethod
    def embedding_scale(config: PretrainedConfig) -> float:
        """The token embeddings' factor after the lookup: 1 (none), sqrt(hidden_size) for CTRL (BioGPT's scales in
        its embedding module, as transformers' does)."""
        return 1.0

    def position_embedding(self, config: PretrainedConfig) -> nn.Module:
        """The table of position embeddings, indexed by position + position_offset: learned (XGLM's: fixed).
        Replicated on every rank: small (GPT-2's 1024 positions), and no all-reduce of its own."""
        wpe = nn.Embedding(config.max_position_embeddings + self.position_offset, config.hidden_size)
        wpe.weight.requires_grad_(False)
        return wpe

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """positions: each token's position in its sequence (so a cached prefix or an earlier chunk counts); None,
        in an encoder pass (see LLM.embed), adds no position embedding, as the rope families rotate nothing."""
        x = self.embed_tokens(input_ids)
        return self.add_positions(x if self.embed_scale == 1.0 else x * self.embed_scale, positions)

    def add_positions(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return x if positions is None else x + self.wpe(positions + self.position_offset)


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(config, name, False):
            raise ValueError(f"{name}=True in the model config: not supported for {config.model_type}")


class GPT2LMHeadModel(LlamaForCausalLM):
    model_class = GPT2Model
    packed_modules_mapping = {}  # c_attn holds q, k and v stacked: its layer's weight_loader splits them
    check_config = staticmethod(check_config)
    # transformers' own GPT2LMHeadModel files name the decoder's tensors `transformer.*`; the Hub's original GPT-2
    # files (GPT2Model's) name them without a prefix.
    weight_name_substitutions = {
        "^transformer.": "",
        "^h.": "model.layers.",
        "^wte.": "model.embed_tokens.",
        "^wpe.": "model.wpe.",
        "^ln_f.": "model.norm.",
        ".ln_1.": ".input_layernorm.",
        ".ln_2.": ".post_attention_layernorm.",
        ".attn.c_attn.": ".self_attn.qkv_proj.",
        ".attn.c_proj.": ".self_attn.o_proj.",
        ".mlp.c_fc.": ".mlp.fc1.",
        ".mlp.c_proj.": ".mlp.fc2.",
    }
    # The Hub's files also hold the attention's causal-mask buffers.
    ignored_weight_suffixes = (".attn.bias", ".attn.masked_bias")

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        scale = None if config.scale_attn_weights else 1.0
        return AttentionOptions(qkv_bias=True, o_bias=True, rope=False, scale=scale)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return GPT2MLP(config, True, config.n_inner or 4 * config.hidden_size, config.activation_function)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
