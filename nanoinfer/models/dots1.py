"""dots.llm1 (`Dots1ForCausalLM`): Qwen3's attention (per-head q/k norms, windows where `layer_types` says) with
DeepSeek-V3's MLPs (deepseek_v3.py): the first `first_k_dense_replace` dense, the others sigmoid-routed experts with
the correction bias plus ungated shared experts."""
from nanoinfer.models.deepseek_v3 import deepseek_v3_mlp
from nanoinfer.models.qwen3 import Qwen3ForCausalLM


class Dots1ForCausalLM(Qwen3ForCausalLM):
    make_mlp = staticmethod(deepseek_v3_mlp)
