"""GLM-MoE-DSA (`GlmMoeDsaForCausalLM`, GLM-5): DeepSeek-V3.2 (deepseek_v32.py) whose indexer ropes interleaved pairs,
and whose layers `indexer_types` marks "shared" have no indexer: they attend to the keys the last "full" layer
selected (cross-layer top-k sharing)."""
from transformers import PretrainedConfig

from nanoinfer.models.deepseek_v32 import DeepseekV32ForCausalLM, DSAOptions

_INDEXER_TYPES = ("full", "shared")


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> DSAOptions:
        indexer_type = config.indexer_types[layer_idx]
        if indexer_type not in _INDEXER_TYPES or (layer_idx == 0 and indexer_type == "shared"):
            raise ValueError(f"indexer_types[{layer_idx}]={indexer_type!r} in the model config; expected one of "
                             f"{_INDEXER_TYPES}, and 'full' for layer 0 (a shared layer reuses an earlier selection)")
        return DSAOptions(rope_interleaved=True, indexer=indexer_type == "full", indexer_rope_interleaved=True)
