"""bf16 on the CPU against transformers in bf16 on the CPU (its torch path: no mamba_ssm, causal-conv1d or fla here, as
on a GPU machine without them). Where transformers keeps a value in fp32 in 16-bit models, so does the engine, bit
for bit against transformers' own modules: Gemma's, Qwen3-Next's and Qwen3.5's (1 + weight) norms and NemotronH's
norms (weight applied in fp32), Mamba's fp32 residual stream (`residual_in_fp32`), the convs' fp32 accumulation
(F.conv1d's), Ling's hybrid's fp32 dt_bias and A_log (its KDA decay, rounded to bf16 after), KDA's and Lara Mini's
gated norms (weight applied in fp32), NemotronH's fp32 sum of the weighted experts, HY-V4's fp32 parameters (its LM
head and sinks among them); so do the MoE blocks of the attention families where a 16-bit step is transformers' own
(GLM-4.5's and DeepSeek-V3's fp32 correction bias and fp32-weighted sum, Mixtral's fp32 routing weights, GPT-OSS's
and GraniteMoE's softmax over the top k logits, Hunyuan MoE's and Flint's fp32 routers, Lara Mini's fp32 softmax (its
weights rounded to bf16), AFMoE's, Laguna's and LFM2-MoE's bf16 ones, Kimi Linear's bf16 correction bias, the
V3-style routers' unsorted top k). Then the recurrent and hybrid families end to end, measured against transformers'
own bf16 rounding error as test_gpu.py measures every family on a GPU (check_bf16_outputs)."""
import dataclasses
import inspect
import math
import sys
import types
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.utils import ModelOutput

from models import (CHAMELEON_IMAGE_TOKENS, CHAMELEON_KINDS, MAMBA1_KINDS, MAMBA2_HYBRID_KINDS, QWEN3_NEXT_KINDS,
                    SSM_KINDS, XLSTM_KIND, check_bf16_outputs, hf_greedy, load_hf_model, random_prompts)
from nanoinfer import LLM, SamplingParams
from nanoinfer.layers.attention.cpu import attention
from nanoinfer.layers.fused_moe import FusedMoE, SparseMoeBlock, relu2, select_experts, select_experts_topk_softmax
from nanoinfer.layers.layernorm import Fp32ResidualRMSNorm, GatedRMSNorm, GemmaRMSNorm, OlmoRMSNorm, RMSNorm
from nanoinfer.layers.linear import copy_weight
from nanoinfer.layers.recurrent import causal_conv1d
from nanoinfer.layers.rotary_embedding import RotaryEmbedding
from nanoinfer.models.afmoe import AfmoeForCausalLM
from nanoinfer.models.beam import BeamMoE
from nanoinfer.models.deepseek_v2 import DeepseekV2MoE
from nanoinfer.models.deepseek_v3 import DeepseekV3MoE
from nanoinfer.models.flint import FlintForCausalLM
from nanoinfer.models.hunyuan_v1_moe import HunYuanMoEV1Moe
from nanoinfer.models.hy_v3 import HYV3ForCausalLM
from nanoinfer.models.kolibri1 import Kolibri1ForCausalLM
from nanoinfer.models.laguna import LagunaMoE
from nanoinfer.models.lara_mini import LaraMiniMoE
from nanoinfer.models.lfm2 import Lfm2MoeBlock
from nanoinfer.models.longcat_flash import LongcatFlashMoE
from nanoinfer.models.minimax_m2 import MiniMaxM2MoE
from nanoinfer.models.mistral4 import Mistral4MoE
from nanoinfer.models.nemotron_h import NemotronHMoE

# Granite 4.0-H's and Qwen3-Next's routers sit at bf16 near-ties on these prompts (Granite's: top-2 and 3rd expert
# 0.002 apart at several tokens of every prompt; Qwen3-Next's: 0.1306 and 0.1288 at prompt 0, step 3), which rounding
# swaps: the logits move by several times the rounding error without a near-tie of the tokens (the reason test_gpu.py
# compares only dense families in bf16). Their layers run here in granitemoehybrid-dense and qwen3.5-moe. Inkling-2's
# (all MLPs routed, 2 of 8 experts) at prompt 3's layer 1: token 36's 2nd and 3rd biased scores 0.82053 and 0.82044
# in transformers' bf16 (0.00119 apart in fp32), token 1's 0.0029 apart where its own bf16 moves a score by 0.0034;
# the engine's layer-1 MLP input is as close to fp32 as transformers' bf16 one (0.070 and 0.065 at most) and chooses
# the other expert, and layer 2's input moves by 2.0; at prompt 1, step 1, layer 2's 2nd and 3rd are 0.011 apart where
# transformers' bf16 moves a score by 0.017. Its norms: test_inkling2_norms_in_bf16_are_transformers_own.
# Inkling-2-Loop's (the same routers, layers 1 and 2 run thrice): transformers' own bf16 chooses other experts than its
# fp32 for up to 9 of a prompt's tokens in one router call (prompt 3, layer 2's last pass); at prompt 1 its last-token
# logits are 1.27 from its fp32 ones (the engine's bf16, 1.41).
ROUTER_NEAR_TIE_KINDS = ("granitemoehybrid", "qwen3-next", "inkling2", "inkling2-loop")
# Inkling: its convs' fp32 weights and state (transformers keeps them in fp32). Kimi Linear and Ling's hybrid: KDA's
# bf16 beta, fp32 gated norm, Kimi's fp32 correction bias and dt_bias (5.25's; 5.23 rounds them), Ling's bf16 decay.
# xLSTM: the whole mLSTM in fp32 (its state dtype), where transformers keeps only the state in fp32 and multiplies in
# bf16 (1.3x its own bf16 error at worst).
BF16_RECURRENT_KINDS = tuple(k for k in MAMBA1_KINDS + SSM_KINDS + MAMBA2_HYBRID_KINDS + QWEN3_NEXT_KINDS
                             + ("inkling", "inkling2", "inkling2-loop", "kimi-linear", "bailing-hybrid", "qwen4-exp",
                                "lara-mini", XLSTM_KIND)
                             if k not in ROUTER_NEAR_TIE_KINDS)
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Batched together: prompt chunks across 16-token scan chunks beside one-token decode steps.
PROMPTS = random_prompts(4, 5, 440, 2, 60, seed=11)


def built_in_bf16(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """A layer built under bf16, as the engine builds a bf16 model."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return build()
    finally:
        torch.set_default_dtype(default)


def _hf_norm(name: str) -> torch.nn.Module:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    return {"gemma3": Gemma3RMSNorm, "qwen3-next": Qwen3NextRMSNorm, "qwen3.5": Qwen3_5RMSNorm,
            "nemotron-h": NemotronHRMSNorm}[name](64)


@pytest.mark.parametrize("family, norm_class", [("gemma3", GemmaRMSNorm), ("qwen3-next", GemmaRMSNorm),
                                                ("qwen3.5", GemmaRMSNorm), ("nemotron-h", OlmoRMSNorm)])
def test_norm_in_bf16_is_transformers_own(family, norm_class):
    """Gemma 3's, Qwen3-Next's and Qwen3.5's norms keep w in the model's dtype, add 1 and multiply in fp32, then
    cast; NemotronH's multiply by w in fp32, then cast: bit for bit, from an fp32 checkpoint into a bf16 model, with
    and without the residual add before it."""
    g = torch.Generator().manual_seed(0)
    w = 0.3 * torch.randn(64, generator=g)  # the checkpoint's (fp32) weight
    hf = _hf_norm(family).to(torch.bfloat16)
    if family == "nemotron-h" and _nemotron_h_norm_multiplies_in_bf16(type(hf)):
        pytest.skip("this transformers' NemotronHRMSNorm multiplies by w in bf16 (5.17 does; 5.23, which we follow, "
                    "in fp32)")
    hf.weight.data.copy_(w)
    ours = built_in_bf16(lambda: norm_class(64))
    ours.weight_loader(ours.weight, w)
    x, residual = (3 * torch.randn(2, 5, 64, generator=g)).bfloat16(), torch.randn(2, 5, 64, generator=g).bfloat16()
    assert torch.equal(ours(x), hf(x))
    out, new_residual = ours(x, residual)
    assert torch.equal(new_residual, x + residual) and torch.equal(out, hf(x + residual))


def test_inkling2_norms_in_bf16_are_transformers_own():
    """Inkling2RMSNorm applies its (bf16) weight in fp32 and rounds once, where Inkling's (and Llama's) round before
    the weight: on the bf16 embedding and the first layer's bf16 input (the other norms' inputs are fp32 depth
    softmaxes, where both agree), the engine's Inkling-2 norms give transformers' numbers bit for bit."""
    module = pytest.importorskip("transformers.models.inkling2.modeling_inkling2",
                                 reason="this transformers has no Inkling-2 (5.17)")
    from models import make_config
    from nanoinfer.models.inkling2 import Inkling2ForCausalLM

    config = make_config("inkling2")
    ours = built_in_bf16(lambda: Inkling2ForCausalLM(config)).model
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 5, config.hidden_size, generator=g)).bfloat16()
    for norm in (ours.embed_tokens.embed_norm, ours.layers[0].input_layernorm):
        w = 1 + 0.3 * torch.randn(config.hidden_size, generator=g)  # the checkpoint's (fp32) weight
        hf = module.Inkling2RMSNorm(config.hidden_size, config.rms_norm_eps).to(torch.bfloat16)
        hf.weight.data.copy_(w)
        getattr(norm, "weight_loader", copy_weight)(norm.weight, w)  # as the engine's loader routes it
        assert torch.equal(norm(x), hf(x))


@pytest.mark.parametrize("family, dtype", [("flint", torch.bfloat16), ("deepseek-v32", torch.float16),
                                          ("glm-moe-dsa", torch.float16), ("axk2", torch.float16),
                                          ("deepseek-v32", torch.bfloat16), ("dots3-note", torch.float16)])
def test_fp32_parameters_are_transformers_own(model_dir, family, dtype):
    """The parameters transformers keeps in fp32 in a 16-bit model are fp32 in the engine's, by name: Flint's sinks
    (and router weight) in bf16 and fp16 (`_keep_in_fp32_modules_strict`); the DeepSeek sparse attention indexer's
    weights_proj in fp16 alone (`_keep_in_fp32_modules`; the correction bias, strict, in both). The engine's sinks
    and weights_proj are in fp32 there alone (its GPT-OSS norms hold fp32 weights of their own)."""
    d = model_dir(family)
    hf = load_hf_model(d, dtype)
    with LLM(str(d), device="cpu", dtype=str(dtype).removeprefix("torch."), max_model_len=64) as llm:
        ours = {name for name, p in llm.llm_engine.model_runner.model.named_parameters() if p.dtype == torch.float32}
    hf_fp32 = {name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
               for name, p in hf.named_parameters() if p.dtype == torch.float32}
    assert hf_fp32 <= ours
    assert {name for name in ours if ".sinks" in name or ".weights_proj." in name} <= hf_fp32


def test_hy_v4_keeps_transformers_fp32_modules_in_bf16(model_dir):
    """transformers keeps HY-V4's LM head, sinks, the indexer's weights_proj and key norm and the hyper-connections in
    fp32 in a bf16 model (`_keep_in_fp32_modules_strict`), the rest in bf16: so does the engine, parameter by
    parameter; its LM head gives transformers' logits (up to fp32 rounding) and its attention with the fp32 sinks
    transformers' eager attention's output bit for bit."""
    module = pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4")
    d = model_dir("hy-v4")
    hf = load_hf_model(d, torch.bfloat16)
    with LLM(str(d), device="cpu", dtype="bfloat16", max_model_len=64) as llm:
        ours = llm.llm_engine.model_runner.model
        dtypes = {name: p.dtype for name, p in ours.named_parameters()}
        hf_dtypes = {name.replace(".self_attn.sinks", ".self_attn.attn.sinks"): p.dtype
                     for name, p in hf.named_parameters() if p.dtype == torch.float32}
        assert {name: dtypes.get(name) for name in hf_dtypes} == hf_dtypes
        assert {p.dtype for name, p in ours.named_parameters() if name not in hf_dtypes} >= {torch.bfloat16}
        g = torch.Generator().manual_seed(0)
        h = torch.randn(5, hf.config.hidden_size, generator=g).bfloat16()
        # fp32 rounding apart (oneDNN's packed weight sums in its own order); from a bf16 head they move by ~1e-2
        torch.testing.assert_close(ours.compute_logits(h), hf.lm_head(h.to(hf.lm_head.weight.dtype)).float(),
                                   rtol=0, atol=1e-5)
    heads, n = 4, 7
    q, k, v = (torch.randn(1, heads, n, 24, generator=g).bfloat16() for _ in range(3))
    sinks = 3 * torch.randn(heads, generator=g)
    hf_attention = types.SimpleNamespace(num_key_value_groups=1, sinks=sinks, training=False)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    expected, _ = module.eager_attention_forward(hf_attention, q, k, v, torch.zeros(n, n).masked_fill(~mask, -math.inf)
                                                 .bfloat16(), 24 ** -0.5)
    assert torch.equal(attention(q, k, v, mask, False, 24 ** -0.5, None, sinks), expected.transpose(1, 2))


def test_ergo_prefill_in_bf16_is_transformers_own(model_dir, captured_logits):
    """Ergo's bf16 model runs its sublayers in bf16 around what transformers keeps in fp32 (the embedding and the
    residual stream, the norms' and gates' weights, the router's logits and correction bias, each expert's normed
    output weighed in fp32, the LM head's logits), rounding where it rounds (the norms' outputs, the routing weights,
    the rope's rotated q and k): each prompt's prefill logits are transformers' bit for bit (any one of these in
    another dtype moves them by 0.01 or more)."""
    d = model_dir("ergo")
    hf = load_hf_model(d, torch.bfloat16)
    with LLM(str(d), device="cpu", dtype="bfloat16", max_model_len=128) as llm:
        for prompt in PROMPTS:  # alone, the head on the last row only: the shapes of transformers' forward
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
            with torch.inference_mode():
                expected = hf(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[0, -1].float()
            assert torch.equal(captured_logits[out.request_id][0].float(), expected)


@dataclasses.dataclass
class StandInOutput(ModelOutput):
    """What a transformers decoder returns, as far as its causal LM's head reads it."""
    last_hidden_state: torch.Tensor | None = None
    past_key_values: object = None
    cache_params: object = None
    cache: object = None  # transformers 5.25's name for both
    hidden_states: object = None
    attentions: object = None
    router_logits: object = None


class StandInDecoder(torch.nn.Module):
    """In place of a transformers causal LM's decoder: its output is the given hidden states, so that the LM's
    forward runs its head alone."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> StandInOutput:
        return StandInOutput(last_hidden_state=self.hidden)


@pytest.mark.parametrize("kind, decoder", [(XLSTM_KIND, "backbone"), ("inkling2", "model")])
def test_logit_soft_cap_in_bf16_is_transformers_own(kind, decoder, model_dir):
    """xLSTM's and Inkling-2's heads cast their bf16 logits to fp32 and soft-cap them there, as the engine's head does
    (ParallelLMHead's fp32 logits): bit for bit (a bf16 rounding after the cap would be worth 0.06 near a cap of 30).
    (RecurrentGemma's and Gemma 2's transformers heads cap in bf16; the engine's cap stays in fp32 there.)"""
    d = model_dir(kind)
    hf = load_hf_model(d, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    hidden = (4 * torch.randn(1, 7, hf.config.get_text_config().hidden_size, generator=g)).bfloat16()
    setattr(hf, decoder, StandInDecoder(hidden))
    with LLM(str(d), device="cpu", dtype="bfloat16", max_model_len=64) as llm, torch.no_grad():
        logits = llm.llm_engine.model_runner.model.compute_logits(hidden[0])
        expected = hf(input_ids=torch.zeros(1, 7, dtype=torch.long)).logits[0]
    assert torch.equal(logits[:, :expected.shape[-1]], expected)


@pytest.mark.parametrize("family, activation", [("kimi_linear", torch.sigmoid), ("bailing_hybrid", torch.sigmoid),
                                                ("lara_mini", F.silu)])
def test_fp32_gated_norm_in_bf16_is_transformers_own(family, activation):
    """KDA's output norm (KimiLinearRMSNormGated, BailingHybridRMSNormGated), and Lara Mini's Gated DeltaNet's
    (LaraMiniRMSNormGated, GLM-5-Next's with SiLU): x / rms(x) times its bf16 weight times activation(gate), all in
    fp32, rounded once; bit for bit (rounded before the weight, as Qwen3-Next's, it is not)."""
    module = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    hf = getattr(module, f"{''.join(p.title() for p in family.split('_'))}RMSNormGated")(64).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    w = 1 + 0.3 * torch.randn(64, generator=g)  # the checkpoint's (fp32) weight
    hf.weight.data.copy_(w)
    ours = built_in_bf16(lambda: GatedRMSNorm(64, 1e-6, activation, weight_in_fp32=True))
    ours.weight.data.copy_(w)
    x, gate = (3 * torch.randn(5, 4, 64, generator=g)).bfloat16(), torch.randn(5, 4, 64, generator=g).bfloat16()
    assert torch.equal(ours(x, gate), hf(x, gate))


def test_mamba_residual_stream_in_fp32_is_transformers_own():
    """transformers' MambaBlock with residual_in_fp32 over three layers, then norm_f and the LM head's cast: the
    embeddings (bf16) enter the stream, each layer normalizes the fp32 stream rounded to bf16 and adds its bf16 output
    to it in fp32, norm_f normalizes the fp32 stream. Bit for bit, the norms' inputs and the final hidden states."""
    from transformers.models.mamba.modeling_mamba import MambaRMSNorm

    g = torch.Generator().manual_seed(0)
    layers, weights = 3, [1 + 0.2 * torch.randn(64, generator=g) for _ in range(4)]
    hf_norms = [MambaRMSNorm(64).to(torch.bfloat16) for _ in range(layers + 1)]
    ours = [built_in_bf16(lambda: Fp32ResidualRMSNorm(64, 1e-6, final=i == layers)) for i in range(layers + 1)]
    for hf, norm, w in zip(hf_norms, ours, weights):
        hf.weight.data.copy_(w)
        norm.weight.data.copy_(w)
    embeddings = (3 * torch.randn(5, 64, generator=g)).bfloat16()
    outputs = [torch.randn(5, 64, generator=g).bfloat16() for _ in range(layers)]  # the mixers' (any bf16 values)

    hidden, hf_normed = embeddings, []  # transformers' MambaBlock.forward, the mixer's output given
    for hf, out in zip(hf_norms, outputs):
        hf_normed.append(hf(hidden.to(torch.bfloat16)))
        hidden = hidden.to(torch.float32) + out
    hf_final = hf_norms[-1](hidden).to(torch.bfloat16)

    normed, residual = ours[0](embeddings), embeddings  # HybridDecoderLayer's first layer: no residual yet
    ours_normed = [normed]
    for norm, out in zip(ours[1:], outputs):
        normed, residual = norm(out, residual)
        ours_normed.append(normed)
    assert residual.dtype == torch.float32 and torch.equal(residual, hidden)
    assert all(torch.equal(a, b) for a, b in zip(ours_normed[:-1], hf_normed))
    assert torch.equal(ours_normed[-1], hf_final)


def test_fp32_residual_norm_is_the_plain_fused_one_in_fp32():
    """In fp32 models nothing changes: the same numbers as RMSNorm's (fused) path, the residual as given."""
    g = torch.Generator().manual_seed(0)
    x, residual, w = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    plain, ours, final = RMSNorm(64), Fp32ResidualRMSNorm(64), Fp32ResidualRMSNorm(64, final=True)
    for norm in (plain, ours, final):
        norm.weight.data.copy_(w)
    expected = plain(x, residual)
    for norm in (ours, final):
        assert all(torch.equal(a, b) for a, b in zip(norm(x, residual), expected))


def test_causal_conv_in_bf16_is_transformers_own():
    """Mamba's causal conv (F.conv1d: products and bias summed in fp32, rounded once before the SiLU) over a prompt,
    then one decode step from the carried state: bit for bit."""
    from transformers.models.mamba.modeling_mamba import causal_conv1d_fn, causal_conv1d_update

    g = torch.Generator().manual_seed(0)
    channels, kernel, n = 96, 4, 21
    x = torch.randn(1, channels, n + 1, generator=g).bfloat16()
    weight, bias = torch.randn(channels, kernel, generator=g).bfloat16(), torch.randn(channels, generator=g).bfloat16()
    hf_prompt = causal_conv1d_fn(x[..., :n], weight, bias, activation="silu")
    hf_step = causal_conv1d_update(x[..., n:], x[..., n - kernel:n].clone(), weight, bias, activation="silu")
    ours, state = causal_conv1d(x[0, :, :n].T, torch.zeros(kernel - 1, channels, dtype=torch.bfloat16), weight, bias)
    ours_step, _ = causal_conv1d(x[0, :, n:].T, state, weight, bias)
    assert torch.equal(ours, hf_prompt[0].T) and torch.equal(ours_step, hf_step[0].T)


def test_bailing_hybrid_decay_in_bf16_is_transformers_own():
    """Ling's bounded KDA decay in a bf16 model from its fp32 dt_bias and A_log (transformers'
    `_keep_in_fp32_modules_strict`, as the conv's weight), against transformers' forget gate: bit for bit, rounded
    to bf16 as transformers' gate returns it (the delta rule takes it in fp32 after). Held in bf16, dt_bias's rounding
    times the head rates (1 to 16) moves it by percents."""
    module = pytest.importorskip("transformers.models.bailing_hybrid.modeling_bailing_hybrid",
                                 reason="this transformers has no Ling hybrid (5.17)")
    from models import make_config
    from nanoinfer.models.bailing_hybrid import BailingHybridDeltaAttention

    config = make_config("bailing-hybrid")
    g = torch.Generator().manual_seed(0)
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    dt = torch.exp(torch.empty(heads * head_dim).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    checkpoint = {"f_proj.weight": 0.3 * torch.randn(heads * head_dim, config.hidden_size, generator=g),
                  "A_log": torch.empty(heads).uniform_(1.0, 16.0, generator=g).log(),
                  "dt_bias": dt + torch.log(-torch.expm1(-dt))}  # transformers' initialisation
    hf = built_in_bf16(lambda: module.BailingHybridForgetGate(config))
    for name in ("A_log", "dt_bias"):  # as from_pretrained keeps them
        getattr(hf, name).data = getattr(hf, name).data.float()
    ours = built_in_bf16(lambda: BailingHybridDeltaAttention(config))
    assert {p.dtype for p in (ours.A_log, ours.dt_bias, ours.conv1d.weight)} == {torch.float32}
    for name, tensor in checkpoint.items():
        hf.get_parameter(name).data.copy_(tensor)
        ours.get_parameter(name).data.copy_(tensor)
    x = torch.randn(1, 64, config.hidden_size, generator=g).bfloat16()
    f = (ours.forget_input(x[0]).float() + ours.dt_bias.float()).view(64, heads, head_dim)
    decay = ours.decay(f)
    assert decay.dtype == torch.bfloat16 and torch.equal(decay, hf(x)[0])


def test_nemotron_h_experts_sum_in_fp32_as_transformers():
    """NemotronHExperts weights each expert's bf16 output by its fp32 routing weight and sums in fp32, rounding
    once: bit for bit (summed in bf16, it is not)."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    config = NemotronHConfig(hidden_size=64, n_routed_experts=8, moe_intermediate_size=32, num_experts_per_tok=2,
                             mlp_hidden_act="relu2")
    # As from_pretrained runs them (transformers 5.25's eager loop sums in bf16; 5.23's, in fp32).
    config._experts_implementation = "grouped_mm"
    g = torch.Generator().manual_seed(0)
    hf = NemotronHExperts(config).to(torch.bfloat16)
    ours = built_in_bf16(lambda: FusedMoE(8, 2, 64, 32, renormalize=False, activation=relu2, gated=False))
    for param, target in ((hf.up_proj, ours.w13_weight), (hf.down_proj, ours.w2_weight)):
        param.data.copy_(0.3 * torch.randn(param.shape, generator=g))
        target.data.copy_(param.data)
    x = torch.randn(40, 64, generator=g).bfloat16()
    weights = 2.5 * torch.rand(40, 2, generator=g)  # fp32, as the sigmoid router's (times routed_scaling_factor)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40)])
    assert torch.equal(ours.run_experts(x, weights, ids), hf(x, ids, weights))


def _hf_v3_moe(family: str) -> tuple[torch.nn.Module, PretrainedConfig]:
    """transformers' GLM-4.5 or DeepSeek-V3 MoE block (sigmoid router with the correction bias in 8 experts of 4
    groups, 4 of them per token from the best 3 groups, renormalized and scaled; one shared expert) with random fp32
    weights, and its config (experts run as from_pretrained runs them: grouped_mm)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as HfDeepseekV3MoE
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    config_class, block = {"glm4-moe": (Glm4MoeConfig, Glm4MoeMoE),
                           "deepseek-v3": (DeepseekV3Config, HfDeepseekV3MoE)}[family]
    config = config_class(hidden_size=64, n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                          n_group=4, topk_group=3, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1)
    config._experts_implementation = "grouped_mm"
    hf = block(config)
    g = torch.Generator().manual_seed(0)
    for param in hf.state_dict().values():
        param.copy_(0.3 * torch.randn(param.shape, generator=g))
    # Scores near 0.5 and biases near 3 (bf16's spacing there: 1/64): rounded to bf16, the bias moves choices.
    hf.gate.weight.data.mul_(0.1)
    hf.gate.e_score_correction_bias.copy_(3 + 0.05 * torch.randn(8, generator=g))
    return hf, config


@pytest.mark.parametrize("family", ["glm4-moe", "deepseek-v3"])
def test_v3_moe_block_in_bf16_is_transformers_own(family):
    """GLM-4.5's and DeepSeek-V3's MoE block, from an fp32 checkpoint into a bf16 model: transformers keeps the
    correction bias in fp32 (`_keep_in_fp32_modules_strict`), weights each expert's bf16 output by its fp32 routing
    weight in fp32 and sums each token's k products in fp32, rounding once, then adds the shared expert. Bit for bit
    (with the bias rounded to bf16 the routing differs at near-ties; with the products rounded to bf16 or summed in
    bf16, most rows differ by an ulp)."""
    import transformers

    hf, config = _hf_v3_moe(family)
    weights = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
    hf.to(torch.bfloat16).gate.e_score_correction_bias = weights["gate.e_score_correction_bias"]
    model_class = {"glm4-moe": transformers.Glm4MoeForCausalLM, "deepseek-v3": transformers.DeepseekV3ForCausalLM}
    if "gate.weight" in (model_class[family]._keep_in_fp32_modules_strict or ()):  # 5.25: the router's weight, as ours
        hf.gate.weight.data = weights["gate.weight"]
    else:  # 5.23 rounds it to bf16: the engine (fp32) given the rounded values
        weights["gate.weight"] = hf.gate.weight.float()
    ours = load_v3_moe_block(built_in_bf16(lambda: DeepseekV3MoE(config)), weights)
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(ours(x), hf(x[None])[0])


def load_v3_moe_block(ours: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A DeepseekV3MoE (or subclass) with the fp32 weights of transformers' V3-style block (`weights`: its state
    dict): the router with its correction bias, the stacked experts, the shared expert's gate, up and down."""
    for target, source in ((ours.gate.weight, "gate.weight"),
                           (ours.gate.e_score_correction_bias, "gate.e_score_correction_bias"),
                           (ours.experts.w13_weight, "experts.gate_up_proj"), (ours.experts.w2_weight,
                                                                               "experts.down_proj"),
                           (ours.shared_experts.down_proj.weight, "shared_experts.down_proj.weight")):
        target.data.copy_(weights[source])
    ours.shared_experts.gate_up_proj.weight.data.copy_(torch.cat([weights["shared_experts.gate_proj.weight"],
                                                                  weights["shared_experts.up_proj.weight"]]))
    return ours


def test_laguna_moe_block_in_bf16_is_transformers_own():
    """Laguna's MoE block in bf16: the routing weights rounded to bf16, the routed experts' bf16 sum times
    `moe_routed_scaling_factor` (in bf16), then the shared expert added. Bit for bit (with the factor in the routing
    weights instead, as DeepSeek's routers apply it, most rows differ)."""
    from transformers import LagunaConfig
    from transformers.models.laguna.modeling_laguna import LagunaSparseMoeBlock

    config = LagunaConfig(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, moe_routed_scaling_factor=2.5,
                          moe_router_logit_softcapping=1.5)
    config._experts_implementation = "grouped_mm"
    hf = LagunaSparseMoeBlock(config)
    g = torch.Generator().manual_seed(0)
    for param in hf.state_dict().values():
        param.copy_(0.3 * torch.randn(param.shape, generator=g))
    weights = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
    ours = load_v3_moe_block(built_in_bf16(lambda: LagunaMoE(config)), weights)
    hf.to(torch.bfloat16)
    x = torch.randn(64, 64, generator=g).bfloat16()
    assert torch.equal(ours(x), hf(x[None])[0])


def test_mixtral_moe_block_in_bf16_is_transformers_own():
    """Mixtral's router leaves its renormalized weights in fp32: each expert's bf16 output times its weight in fp32,
    each token's two products summed in fp32, rounded once. Bit for bit (rounding the weights to bf16 first, as
    Qwen's routers do, most rows differ)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    config._experts_implementation = "grouped_mm"
    hf = MixtralSparseMoeBlock(config)
    g = torch.Generator().manual_seed(0)
    for param in hf.state_dict().values():
        param.copy_(0.3 * torch.randn(param.shape, generator=g))
    ours = built_in_bf16(lambda: SparseMoeBlock(config, 8, 32, renormalize=True, fp32_weights=True))
    for target, source in ((ours.gate.weight, hf.gate.weight), (ours.experts.w13_weight, hf.experts.gate_up_proj),
                           (ours.experts.w2_weight, hf.experts.down_proj)):
        target.data.copy_(source.data)
    hf.to(torch.bfloat16)
    x = torch.randn(64, 64, generator=g).bfloat16()
    assert torch.equal(ours(x), hf(x[None])[0])


def _hf_topk_softmax_router(family: str) -> torch.nn.Module:
    from transformers import GptOssConfig, GraniteMoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter

    if family == "gpt-oss":
        return GptOssTopKRouter(GptOssConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=4))
    return GraniteMoeTopKRouter(GraniteMoeConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=4))


@pytest.mark.parametrize("family", ["gpt-oss", "granitemoe"])
def test_topk_softmax_routing_in_bf16_is_transformers_own(family):
    """GPT-OSS's and GraniteMoE's routers softmax the top k bf16 router logits among themselves (in fp32) and round
    to bf16: bit for bit (the full softmax's top k renormalized, equal in exact arithmetic, rounds about one weight
    in 10^5 to the neighbouring bf16 number: hence the many tokens)."""
    hf = _hf_topk_softmax_router(family)
    g = torch.Generator().manual_seed(0)
    for param in hf.parameters():
        param.data.copy_(torch.randn(param.shape, generator=g))
    hf.to(torch.bfloat16)
    x = torch.randn(65536, 64, generator=g).bfloat16()
    out = hf(x)
    if family == "granitemoe" and out[0].dtype == torch.long:
        pytest.skip("this transformers' GraniteMoeTopKRouter returns (ids, weights, logits) and routes otherwise (5.17 "
                    "does; 5.23's top-k softmax, which we follow, returns (logits, weights, ids))")
    logits, hf_weights, hf_ids = out
    weights, ids = select_experts_topk_softmax(logits.to(torch.bfloat16), 4)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


# DeepSeek's routing in 4 groups of 2 experts, the best 3 groups' 4 best experts per token.
_V3_GROUPS = {"n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 3,
              "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.5}
# Each family's router in transformers (its module, router, config and model classes), the engine's MoE block for
# the family's config, and the config's routing (8 experts, 2 per token).
_ROUTERS = {
    "hunyuan-moe": ("hunyuan_v1_moe", "HunYuanMoEV1Gate", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
                    lambda config: HunYuanMoEV1Moe(config, 0), {"num_experts": 8, "moe_topk": 2}),
    "flint": ("flint", "FlintTopKRouter", "FlintConfig", "FlintForCausalLM",
              lambda config: FlintForCausalLM.make_mlp(config, 0),
              {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": []}),
    "kolibri1": ("kolibri1", "Kolibri1TopKRouter", "Kolibri1Config", "Kolibri1ForCausalLM",
                 lambda config: Kolibri1ForCausalLM.make_mlp(config, 0),
                 {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "lara-mini": ("lara_mini", "LaraMiniTopKRouter", "LaraMiniConfig", "LaraMiniForCausalLM", LaraMiniMoE,
                  {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "afmoe": ("afmoe", "AfmoeTokenChoiceRouter", "AfmoeConfig", "AfmoeForCausalLM",
              lambda config: AfmoeForCausalLM.make_mlp(config, 1),
              {"num_experts": 8, "num_experts_per_tok": 2, "route_scale": 2.5}),
    "laguna": ("laguna", "LagunaTopKRouter", "LagunaConfig", "LagunaForCausalLM", LagunaMoE,
               {"num_experts": 8, "num_experts_per_tok": 2, "moe_router_logit_softcapping": 1.5}),
    "lfm2-moe": ("lfm2_moe", "Lfm2MoeTopKRouter", "Lfm2MoeConfig", "Lfm2MoeForCausalLM", Lfm2MoeBlock,
                 {"num_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 2.5}),
    # 4 per token: CPU's torch.topk(sorted=False) returns 2 sorted, 4 not.
    "hy-v3": ("hy_v3", "HYV3TopKRouter", "HYV3Config", "HYV3ForCausalLM",
              lambda config: HYV3ForCausalLM.make_mlp(config, 1),
              {"num_local_experts": 8, "num_experts": 8, "num_experts_per_tok": 4, "router_scaling_factor": 2.5}),
    "minimax-m2": ("minimax_m2", "MiniMaxM2TopKRouter", "MiniMaxM2Config", "MiniMaxM2ForCausalLM", MiniMaxM2MoE,
                   {"num_local_experts": 8, "num_experts_per_tok": 4}),
    "deepseek-v3": ("deepseek_v3", "DeepseekV3TopkRouter", "DeepseekV3Config", "DeepseekV3ForCausalLM", DeepseekV3MoE,
                    {**_V3_GROUPS, "norm_topk_prob": True}),
    "deepseek-v2": ("deepseek_v2", "DeepseekV2TopkRouter", "DeepseekV2Config", "DeepseekV2ForCausalLM", DeepseekV2MoE,
                    {**_V3_GROUPS, "topk_method": "group_limited_greedy"}),
    "nemotron-h": ("nemotron_h", "NemotronHTopkRouter", "NemotronHConfig", "NemotronHForCausalLM", NemotronHMoE,
                   {**_V3_GROUPS, "norm_topk_prob": True, "moe_shared_expert_intermediate_size": 32,
                    "mlp_hidden_act": "relu2"}),
    # 4 per token (sorted); transformers' Beam router leaves the scaling to its MoE block's output: 1 here.
    "beam": ("beam", "BeamTopKRouter", "BeamConfig", "BeamForCausalLM", BeamMoE,
             {**_V3_GROUPS, "num_experts": 8, "norm_topk_prob": True, "routed_scaling_factor": 1.0}),
    # Softmax scores, grouped as V3's, every step in bf16.
    "mistral4": ("mistral4", "Mistral4TopkRouter", "Mistral4Config", "Mistral4ForCausalLM", Mistral4MoE,
                 {**_V3_GROUPS, "norm_topk_prob": True}),
    "kimi-linear": ("kimi_linear", "KimiLinearTopkRouter", "KimiLinearConfig", "KimiLinearForCausalLM",
                    DeepseekV3MoE, {**_V3_GROUPS, "num_experts": 8, "norm_topk_prob": True}),
    # 6 real and 2 zero experts, 4 per token.
    "longcat-flash": ("longcat_flash", "LongcatFlashTopkRouter", "LongcatFlashConfig", "LongcatFlashForCausalLM",
                      LongcatFlashMoE, {"n_routed_experts": 6, "zero_expert_num": 2, "moe_topk": 4,
                                        "expert_ffn_hidden_size": 32, "routed_scaling_factor": 2.5}),
}
# The routers given the correction bias by their MoE block, and its dtype there (AFMoE's stays fp32 in fp16 models
# alone, LFM2-MoE's is an fp32 buffer, HY3's strictly kept in fp32, MiniMax-M2's a buffer of the model's dtype).
_BIAS_FROM_BLOCK = {"afmoe": torch.bfloat16, "lfm2-moe": torch.float32, "hy-v3": torch.float32,
                    "minimax-m2": torch.bfloat16}
# The routers whose weight transformers 5.25 keeps in fp32 in 16-bit models, as the engine does, and 5.23 rounds to
# bf16 (and Kimi Linear's correction bias, a bf16 buffer in 5.23).
_FP32_SINCE_5_25 = {"hy-v3", "deepseek-v3", "deepseek-v2", "nemotron-h", "kimi-linear"}
# Where the engine's blocks hold the checkpoint's router weight and correction bias.
_OUR_ROUTER_PARAMS = {"gate.weight": "weight", "gate.e_score_correction_bias": "e_score_correction_bias",
                      "expert_bias": "e_score_correction_bias", "e_score_correction_bias": "e_score_correction_bias"}


def _hf_router_in_bf16(family: str, checkpoint: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, PretrainedConfig]:
    """transformers' router for `family` as from_pretrained(dtype=bfloat16) builds it from an fp32 checkpoint: built
    under bf16 (Hunyuan's weight stays fp32, its own dtype), the model's `_keep_in_fp32_modules_strict` in fp32, the
    checkpoint cast to each tensor's dtype; and the family's config."""
    import transformers

    module_name, router_name, config_name, model_name, _, routing = _ROUTERS[family]
    module = pytest.importorskip(f"transformers.models.{module_name}.modeling_{module_name}",
                                 reason=f"this transformers has no {family} (5.17 has no Flint, Kolibri-1, Beam or "
                                        f"Mistral 4)")
    config = getattr(transformers, config_name)(hidden_size=64, **routing)
    hf = built_in_bf16(lambda: getattr(module, router_name)(config))
    keep = getattr(module, model_name)._keep_in_fp32_modules_strict or []
    for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
        if any(k in f"mlp.gate.{name}" for k in keep):
            tensor.data = tensor.data.float()
        # Hunyuan's, AFMoE's, LongCat-Flash's names
        tensor.data.copy_(checkpoint[name.removeprefix("wg.").removeprefix("gate.").removeprefix("classifier.")])
    return hf, config


@pytest.mark.parametrize("family", list(_ROUTERS))
def test_router_in_bf16_is_transformers_own(family):
    """Routers in a bf16 model from an fp32 checkpoint, where transformers' dtypes are their own: Hunyuan MoE's
    (built in fp32: fp32 logits and routing weights), Flint's (its weight kept in fp32,
    `_keep_in_fp32_modules_strict`), Kolibri-1's (bf16 weight upcast, fp32 correction bias), Lara Mini's (bf16
    weight upcast, an fp32 softmax, its weights rounded to bf16), AFMoE's and Laguna's (bf16 logits upcast, bf16
    correction bias; Laguna's weights rounded to bf16), LFM2-MoE's (sigmoid, renormalized and scaled in bf16, an fp32
    expert bias), HY3's, MiniMax-M2's, DeepSeek-V2's, V3's and NemotronH's (the top k unsorted, the order the experts'
    fp32 sum follows), Beam's (its weight kept in fp32, the top k sorted), LongCat-Flash's (fp32 logits of a bf16
    weight, a bf16 correction bias, zero experts among the chosen), Mistral 4's (bf16 logits, softmax, group scores
    and routing weights). Bit for bit on the routing weights and the chosen
    experts, in order (in another dtype, the weights differ and near-ties choose other experts)."""
    g = torch.Generator().manual_seed(0)
    checkpoint = {"weight": 0.3 * torch.randn(8, 64, generator=g),
                  "e_score_correction_bias": 0.05 * torch.randn(8, generator=g)}
    hf, config = _hf_router_in_bf16(family, checkpoint)
    if family in _FP32_SINCE_5_25:  # under 5.23, the engine given the values transformers rounded (5.25's are fp32)
        checkpoint = {name: hf_tensor.float() if (hf_tensor := getattr(hf, name, None)) is not None else tensor
                      for name, tensor in checkpoint.items()}
    ours = built_in_bf16(lambda: _ROUTERS[family][4](config))
    for name, param in ours.named_parameters():
        if name in _OUR_ROUTER_PARAMS:
            param.data.copy_(checkpoint[_OUR_ROUTER_PARAMS[name]])
    x = torch.randn(65536, 64, generator=g).bfloat16()
    if family in _BIAS_FROM_BLOCK:
        bias = checkpoint["e_score_correction_bias"].to(_BIAS_FROM_BLOCK[family])
        _, hf_weights, hf_ids = hf(x[None] if family == "afmoe" else x, bias)  # AFMoE's takes [batch, tokens, hidden]
    else:  # transformers 5.17's LongCat-Flash router returns no logits
        *_, hf_weights, hf_ids = hf(x)
    if family == "hunyuan-moe":  # a SparseMoeBlock: FusedMoE routes the router's logits
        weights, ids = select_experts(ours.gate(x), ours.experts.top_k, ours.experts.renormalize,
                                      ours.experts.fp32_weights)
    else:
        weights, ids = ours.select_experts(x)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


def _nemotron_h_norm_multiplies_in_bf16(norm_class: type) -> bool:
    """Whether this transformers' NemotronHRMSNorm multiplies by its weight in bf16 (5.17's) rather than fp32."""
    return "float32" not in inspect.getsource(norm_class.forward).split("return")[-1]


@pytest.mark.parametrize("kind", BF16_RECURRENT_KINDS)
def test_bf16_matches_transformers_up_to_bf16_rounding(kind, model_dir, captured_logits, report_logit_diff):
    d = model_dir(kind)
    if kind == "kimi-linear" and "dt_bias" not in (load_hf_model(d)._keep_in_fp32_modules_strict or ()):
        pytest.skip("this transformers' Kimi Linear rounds its router's weight, correction bias and dt_bias to bf16 "
                    "(5.23 does; 5.25, which we follow, keeps them in fp32)")
    if kind == "inkling":
        from transformers.models.inkling.modeling_inkling import InklingTopkRouter
        if "flat.float()" not in inspect.getsource(InklingTopkRouter.forward):
            pytest.skip("this transformers' Inkling routes on bf16 logits (5.17 does; 5.23, which we follow, on fp32 "
                        "ones)")
    if kind == "nemotron-h" and _nemotron_h_norm_multiplies_in_bf16(type(_hf_norm("nemotron-h"))):
        # With its router's weight rounded to bf16 too (5.23 rounds that alone, and stays within the bound): 20x
        # transformers' own bf16 error by step 15.
        pytest.skip("this transformers' NemotronH rounds its router's weight and its norms' product to bf16 (5.17 "
                    "does; 5.25, which we follow, neither)")
    with LLM(str(d), device="cpu", dtype="bfloat16", max_model_len=128) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    refs = hf_greedy(load_hf_model(d, torch.bfloat16), PROMPTS, MAX_TOKENS)
    worst = check_bf16_outputs(outputs, PROMPTS, refs, captured_logits, load_hf_model(d),
                               load_hf_model(d, torch.bfloat16, attn_implementation="eager"))
    report_logit_diff(f"{kind}, CPU bf16 (x transformers' own bf16 error)", worst)


@pytest.mark.parametrize("kind", CHAMELEON_KINDS)
def test_chameleon_bf16_matches_transformers_up_to_bf16_rounding(kind, model_dir, captured_logits,
                                                                  report_logit_diff):
    """Chameleon in bf16 (its per-head q/k LayerNorms rounded as transformers rounds them): within transformers' own
    bf16 error of its bf16 logits, the image tokens' logits bf16's minimum as transformers' bf16 wrapper sets them
    (not fp32's, though the engine's logits are fp32)."""
    d = model_dir(kind)
    with LLM(str(d), device="cpu", dtype="bfloat16", max_model_len=128) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for out in outputs:
        rows = torch.stack(captured_logits[out.request_id])
        assert rows[:, list(CHAMELEON_IMAGE_TOKENS)].eq(torch.finfo(torch.bfloat16).min).all()
    refs = hf_greedy(load_hf_model(d, torch.bfloat16), PROMPTS, MAX_TOKENS)
    worst = check_bf16_outputs(outputs, PROMPTS, refs, captured_logits, load_hf_model(d),
                               load_hf_model(d, torch.bfloat16, attn_implementation="eager"))
    report_logit_diff(f"{kind}, CPU bf16 (x transformers' own bf16 error)", worst)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "qwen2-moe", "qwen3-moe", "qwen3-next",
                                  "qwen3.5"])
def test_rope_in_bf16_is_transformers_own(kind, model_dir):
    """These families' rope in transformers rounds cos, sin, each product and each sum to bf16 (Llama's
    apply_rotary_pos_emb over cos and sin cast to the activations' dtype): the engine's layers rotate bit for bit
    alike, where one fp32 rotation rounded once differs in about a third of the elements."""
    d = model_dir(kind)
    hf = load_hf_model(d, torch.bfloat16)
    apply_rotary_pos_emb = sys.modules[type(hf.model.rotary_emb).__module__].apply_rotary_pos_emb
    with LLM(str(d), device="cpu", dtype="bfloat16", max_model_len=512) as llm:
        rope = next(m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, RotaryEmbedding))
        g = torch.Generator().manual_seed(0)
        x = (3 * torch.randn(64, 4, rope.head_dim, generator=g)).bfloat16()
        positions = torch.randint(0, 512, (64,), generator=g)
        ours = rope.rotate(positions, x)
    # transformers 5.17's Qwen3.5 rope takes its mrope's three rows of positions (5.25 broadcasts one).
    cos, sin = hf.model.rotary_emb(x, positions[None].expand(3, 1, -1) if kind == "qwen3.5" else positions[None])
    assert cos.dtype == torch.bfloat16
    q = x.transpose(0, 1)[None]
    assert torch.equal(ours, apply_rotary_pos_emb(q, q, cos, sin)[0][0].transpose(0, 1))
