"""Zamba (`ZambaForCausalLM`, Zyphra's Zamba-7B-v1): Zamba2's layout (zamba2.py) around Zamba's multi-head Mamba-1
mixer (layers/mamba.py's MultiHeadMambaMixer): Mamba layers, and hybrid layers (`layers_block_type`, from
`attn_layer_period` / `attn_layer_offset`) that first run the one shared attention + MLP block, without rope or
adapters, on concat(hidden, embeddings), each invocation with its own KV cache and linear back to the hidden size."""
from transformers import PretrainedConfig

from nanoinfer.layers.mamba import MambaSettings, MultiHeadMambaMixer
from nanoinfer.models.hybrid import HybridDecoderLayer
from nanoinfer.models.zamba2 import Zamba2ForCausalLM, Zamba2Model


def check_config(config: PretrainedConfig) -> None:
    """The shapes and options the shared block and mixer here assume (transformers lets them vary)."""
    where = f"in {config.name_or_path or 'the model config'}"
    width, heads = 2 * config.hidden_size, config.num_attention_heads
    if config.attention_hidden_size != width:
        raise ValueError(f"attention_hidden_size={config.attention_hidden_size} is not supported {where}: the shared "
                         f"attention's input is concat(hidden, embeddings), 2 x hidden_size={width}")
    if width % heads or config.attention_head_dim != width // heads:
        raise ValueError(f"attention_head_dim={config.attention_head_dim} is not supported {where}: the heads must "
                         f"split 2 x hidden_size={width} (num_attention_heads={heads})")
    if config.hidden_mamba_act != "silu":
        raise ValueError(f"hidden_mamba_act={config.hidden_mamba_act!r} is not supported {where}: only 'silu' is "
                         f"implemented for the Mamba conv")


def zamba_mamba_settings(config: PretrainedConfig) -> MambaSettings:
    return MambaSettings(config.hidden_size, config.mamba_expand * config.hidden_size, config.mamba_d_state,
                         config.mamba_d_conv, int(config.mamba_dt_rank), config.mamba_conv_bias,
                         config.mamba_proj_bias, config.hidden_mamba_act, n_heads=config.n_mamba_heads)


def mamba_layer(config: PretrainedConfig) -> HybridDecoderLayer:
    """x + mixer(norm(x)): a Mamba layer, and the second half of a hybrid one."""
    return HybridDecoderLayer(config, MultiHeadMambaMixer(zamba_mamba_settings(config)), False, None,
                              config.rms_norm_eps)


class ZambaModel(Zamba2Model):
    adapted = False
    check_config = staticmethod(check_config)
    mamba_layer = staticmethod(mamba_layer)

    @staticmethod
    def layout(config: PretrainedConfig) -> tuple[list[int], int]:
        """Every hybrid layer invokes the one shared block."""
        return [i for i, kind in enumerate(config.layers_block_type) if kind == "hybrid"], 1


class ZambaForCausalLM(Zamba2ForCausalLM):
    model_class = ZambaModel
    packed_modules_mapping = Zamba2ForCausalLM.packed_modules_mapping | {
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # The shared block's checkpoint name (Zamba2's is shared_transformer), then Zamba2's.
    weight_name_substitutions = ({".shared_transf.": ".shared_transformer."}
                                 | Zamba2ForCausalLM.weight_name_substitutions)
