"""Tiny, deterministic, fully local test models + Hugging Face reference helpers.

Nothing here touches the network: the tokenizer is trained on an inlined corpus and
the models are random-weight instances of transformers' own architectures.

Public API (used by conftest.py and the engine tests):

    build_tokenizer(dir) -> PreTrainedTokenizerFast
    build_model(kind, dir) -> pathlib.Path          kinds: see MODEL_KINDS / ALL_KINDS
    hf_greedy(model_dir, prompts_token_ids, max_new_tokens) -> list[dict]
    hf_forward_logits(model_dir, token_ids) -> Tensor [len, vocab]
    hf_encoder_states(model_dir, token_ids) -> Tensor [len, hidden]   (bidirectional, no RoPE)
    load_hf_model(model_dir) -> cached transformers model
    assert_greedy_match(ours, ref_tokens, ref_logits, tol=1e-4)
    top2_gaps(logits) -> Tensor
    random_prompts(n, vocab_lo, vocab_hi, len_lo, len_hi, seed) -> list[list[int]]
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import pathlib
import random
from typing import Sequence

import torch

# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, IM_START, IM_END]  # ids 0..4

TOKENIZER_VOCAB_SIZE = 448  # <= every model's vocab_size (512)
MODEL_VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model reads a sequence of tokens
and predicts the next one. During inference the model keeps a cache of keys and values for every
layer, so that each new token only needs a single forward step instead of reprocessing the prompt.

Once upon a time there was a small village by the sea. Every morning the fishermen went out in
their boats, and every evening they came back with baskets full of silver fish. The children ran
along the beach, collecting shells and telling stories about the great whale that lived far away.

In computer science, scheduling is the action of assigning resources to perform tasks. A scheduler
decides which requests run now and which ones wait. When memory is scarce, some requests may be
preempted and resumed later. Paged attention stores the cache in fixed-size blocks, which makes
memory management simple and allows blocks to be shared between sequences with a common prefix.

The weather today is sunny with a light breeze from the west. Tomorrow there will be clouds in the
morning and some rain in the afternoon. Temperatures will stay between twelve and eighteen degrees.
Please remember to bring an umbrella if you are going outside after lunch.

Hello! How are you? I am fine, thank you. What is your name? My name is Ada, and I like numbers:
one, two, three, four, five, six, seven, eight, nine, ten. Python is a programming language that
lets you work quickly and integrate systems more effectively. print("hello world") returns None.
def add(a, b): return a + b  # 1 + 2 = 3; 10 * 10 = 100; [1, 2, 3] {"key": "value"}
"""


def _corpus_lines() -> list[str]:
    # Repeat the corpus a few times so min_frequency does not prune everything.
    return [line for line in _CORPUS.splitlines() if line.strip()] * 3


def _train_tokenizer_object(special_tokens: Sequence[str] = SPECIAL_TOKENS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _corpus_lines()
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def build_tokenizer(dir) -> "transformers.PreTrainedTokenizerFast":  # noqa: F821
    """Train a deterministic byte-level BPE tokenizer and save it (HF format) into `dir`."""
    from transformers import PreTrainedTokenizerFast

    dir = pathlib.Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer_object(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(dir))
    return tok


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------

MODEL_KINDS = ("qwen3", "qwen3-untied", "qwen2", "llama")  # the 4 main architectures
# Further families, each tested on its own (not in every any_model_dir test).
# Qwen3-Next: Gated DeltaNet + gated attention layers, a dense MLP and sparse MoE ones. Qwen3.5: the same layers
# with the linear attention's projections stored per output, dense MLPs; Qwen3.5-MoE: experts on every layer.
QWEN3_NEXT_KINDS = ("qwen3-next", "qwen3.5", "qwen3.5-moe")
# Gemma 3: sliding and full layers with different ropes, (1 + weight) norms, GeLU-tanh, final-logit softcapping.
# Gemma 2: Gemma 3's layout without q/k norms, one rope, attention-logit softcapping. Gemma: two norms per layer, no
# softcapping, no window, one KV head (as Gemma-2B).
# Phi-3: fused qkv_proj / gate_up_proj, partial rotary, longrope, a window on every layer.
# Granite: embedding, attention, residual and logit multipliers. SmolLM3: a NoPE layer, windowed.
# OLMo 2: RMSNorms over the whole q / k projections, norms after the sublayers. OLMo 3: plus sliding and full layers
# with different ropes.
# GLM-4-0414: four norms per layer (Gemma 2's order), interleaved rope over half of each head, fused gate_up_proj,
# q/k/v biases. GLM-4 (v1): the same without the norms after the sublayers, a quarter of each head rotated, MQA.
# Mixtral: a window on every layer and 2 of 8 experts per token on every layer, renormalized. PhiMoE (phimoe):
# Mixtral's layout with LayerNorms, biases on q/k/v/o and the LM head, longrope (its own: short factors, short and long
# mscales) and the sparsemixer, its threshold (router_jitter_noise) wide enough that some tokens' weights mix experts.
# FlexOLMo: OLMo 2's layers (q/k/v/o biases) with 2 of 8 experts, renormalized. VaultGemma: Gemma 2's attention
# (windowed layers, softcaps) and MLP in Gemma's two-norm layer. EXAONE-MoE (exaone-moe): EXAONE 4's attention (a
# window and rope on layers 0 and 2, a global NoPE layer 1) with V3's MoE from layer 1 on (2 of 8 experts in the best
# 2 of 4 groups, a random correction bias, a shared expert). GraniteSWA (granite-swa) and GraniteMoeSWA
# (granitemoe-swa, GraniteMoeShared's MLPs): Granite's multipliers, sinks (GPT_OSS_SINK_STD), windowed layers 0 and 2,
# a rope base per layer, layer 1 without rope. Qwen2-MoE: 2 of 8
# experts (not renormalized) plus a gated shared expert on layers 0 and 2, layer 1 dense. Granite MoE: Granite's
# multipliers around 2 of 8 experts (and, shared, an ungated shared expert). OLMoE: OLMo 2's whole-projection q/k
# norms and q/k/v clipped to +-clip_qkv (which binds) in the pre-norm layer, 2 of 8 experts, not renormalized.
# GLM-4.5 (glm4-moe): q/k/v biases, per-head q/k norms, half of each head rotated (neox layout), layer 0 dense, then
# DeepSeek-V3's routing (sigmoid, a random correction bias, 2 of 4 groups, renormalized, scaled) plus a shared expert.
# dots.llm1 (dots1): Qwen3's attention (q/k/v/o biases, windowed layer 2) with V3's MLPs: layer 0 dense, one group, two
# shared experts. ERNIE 4.5 MoE (ernie4.5-moe): biases on every projection, interleaved rope, layers 1 and 2 sparse: 2 of
# 8 experts chosen by softmax + a random correction bias, plus two shared experts. Hunyuan MoE (hunyuan-moe): q/k norms
# after an NTK-alpha rope, q/k/v/o biases, 8 experts, a top k per layer (2, 1, 3), a shared MLP.
# Llama 4 (llama4): interleaved llama3 rope with a weightless q/k norm after it on layers 0-2, layer 3 NoPE with
# attention temperature tuning (floor_scale 4, so the queries' scale grows over the test lengths), layers 1 and 3
# 2 of 8 experts by sigmoid of the top router logits (applied to the experts' input) plus a shared expert, layers 0
# and 2 dense and wider; layers 0-2's attention chunked in LLAMA4_CHUNK tokens (chunk boundaries inside 16-token
# blocks and at their edges).
# Solar Open (solar-open): GLM-4.5's layout without q/k norms, experts on every layer (2 of 4 groups). MiniMax-M2
# (minimax-m2): OLMoE's whole-projection q/k norms, half of each head rotated, 2 of 8 experts by sigmoid + a random
# correction bias, renormalized. Cohere 2 MoE (cohere2-moe): Cohere 2's layer with a wider dense layer 0 (full and
# roped), then 2 of 8 experts softmaxed over the top 2, a shared expert averaged in; cohere2-moe-sigmoid: RMSNorms,
# sigmoid weights renormalized, the shared expert summed.
# DeepSeek (DEEPSEEK_KINDS), multi-head latent attention with V narrower than K (16 against 16 + 8) and MoE with
# shared experts: V2: the plain q_proj (as V2-Lite), 2 of 8 experts on every layer by softmax, yarn rope with
# distinct mscale / mscale_all_dim (the rope's and the scores' scaling). V2-group: the low-rank q, layer 0 dense,
# group-limited routing (3 experts from the best 2 of 4 groups: with 2 the limit could never bind),
# routed_scaling_factor. V3: layer 0 dense, sigmoid routing with a random e_score_correction_bias within 2 of 4
# groups, renormalized and scaled; interleaved rope.
# The LayerNorm families (LAYERNORM_KINDS), every norm with a random bias and an epsilon (LAYER_NORM_EPS) far from
# the default: StarCoder2: biases on q/k/v/o and a GeLU-tanh MLP, GQA, a window on every layer. StableLM: q/k/v
# biases, per-head q/k LayerNorms (GQA), the parallel residual with one norm, a quarter of each head rotated. Phi:
# the same residual, q/k LayerNorms shared by the heads, biases everywhere (the LM head's too), "gelu_new". GPT-NeoX:
# the per-head fused query_key_value, the parallel residual with two norms, a quarter rotated, exact GeLU.
# Cohere: the parallel residual with one bias-free norm, per-head q/k LayerNorms (GQA), interleaved rope, logit_scale.
# GPT-2: learned absolute positions, Conv1D (transposed) weights, the fused c_attn, "gelu_new", tied.
# Falcon: the new decoder architecture (GQA, the fused query_key_value grouped by KV head, two norms in parallel),
# biases; falcon-mqa: the 7B style, multi-query, one norm in parallel, no biases, untied.
# GPT-J: the parallel residual with one norm, interleaved rope over half of each head, the LM head's bias.
# GPTBigCode: GPT-2's layout with nn.Linear weights and multi-query attention, exact GeLU.
# Cohere 2: Cohere's layer without q/k norms, sliding layers with rope and a global one without.
# BLOOM: ALiBi with 6 heads (not a power of two: the slopes' second series), the per-head fused query_key_value, the
# embeddings' LayerNorm, tied. MPT: ALiBi (alibi_bias_max 8), bias-free, q/k/v clamped (clip_qkv, below many of the
# test model's values), its own softmax_scale, tied.
# OPT: GPT-2's positions offset by 2, pre-norm, ReLU, biases, tied. opt-350m: post-norm (no final norm), token
# embeddings narrower than the hidden size (project_in / project_out), no biases on the projections (enable_bias false).
# GPT-Neo: GPT-2's layout with separate q/k/v, unscaled scores, local (windowed) layers 0 and 2, a global layer 1.
# CodeGen: GPT-J's layer with the fused qkv_proj in its 4-group layout (8 heads: 2 per group, so the order within a
# group shows), interleaved rope over half of each head.
# Persimmon: GPT-NeoX's per-head query_key_value, q/k LayerNorms shared by the heads, half of each head rotated, relu^2.
# BioGPT: OPT's pre-norm layers, embeddings scaled by sqrt(hidden), a config epsilon (LAYER_NORM_EPS) its LayerNorms
# ignore, GeLU, tied. XGLM: the same on fixed sinusoidal positions whose row pad_token_id (2: position 0's) is zeroed.
# CTRL: sinusoidal positions added to embeddings scaled by sqrt(hidden), pre-norm layers whose LayerNorms take a fixed
# 1e-6 (the config's epsilon, LAYER_NORM_EPS, the final norm's alone), ReLU, biases, the tied LM head's bias.
# OpenAI GPT (openai-gpt): GPT-2's layout in post-norm layers without a final norm, its "gelu" (the tanh one).
# GPT-NeoX-Japanese (gpt-neox-japanese): GPT-NeoX's per-head query_key_value without biases, rope over the whole head
# (as the released checkpoint: transformers 5.17's own partial rope fails), sequential LayerNorms, a bias-free MLP 3x
# wide, the last layer's output-projection bias, tied.
# The decoders of encoder-decoder models run alone (transformers' *ForCausalLM, cross-attention in the checkpoint,
# skipped), by model type -> transformers' class-name stem; their layers fairseq's (q/k/v/out and fc1/fc2 with
# biases, ReLU or GeLU), their LayerNorms at nn.LayerNorm's epsilon. BART: post-LN layers, learned positions offset by
# 2 rows, scaled embeddings, the embeddings' LayerNorm after the positions, tied; PLBART and MVP (prompts off) the same
# under their own classes. mBART: BART's with pre-LN layers and a final norm, untied. Marian: post-LN on a fixed
# sinusoidal table (sines | cosines; saved in the checkpoint, as transformers' file has it). Pegasus: pre-LN on that
# table, embeddings scaled after the lookup (input embeddings too). Blenderbot: pre-LN, learned positions from row 0.
# Blenderbot Small: post-LN, the embeddings' LayerNorm before the positions are added, scale_embedding (its decoder
# ignores it). Whisper: pre-LN, learned positions from row 0 (max_target_positions), no key bias, scale_embedding
# ignored too. MVP's embeddings unscaled (transformers scales its token ids' alone, not input embeddings). TrOCR:
# BART's post-LN layers and offset positions without the embeddings' LayerNorm (`layernorm_embedding` false).
# BigBird-Pegasus: pre-LN, learned positions from row 0, the final norm named `layernorm_embedding`, no attention
# biases (`use_bias` false), an LM head of its own whatever `tie_word_embeddings` says (its class never ties).
SEQ2SEQ_DECODER_KINDS = {"bart": "Bart", "mbart": "MBart", "marian": "Marian", "pegasus": "Pegasus",
                         "blenderbot": "Blenderbot", "blenderbot-small": "BlenderbotSmall", "plbart": "PLBart",
                         "mvp": "Mvp", "trocr": "TrOCR", "bigbird-pegasus": "BigBirdPegasus", "whisper": "Whisper"}
LAYERNORM_KINDS = ("starcoder2", "stablelm", "phi", "gpt-neox", "cohere", "gpt2", "falcon", "falcon-mqa", "gptj",
                   "gpt-bigcode", "cohere2", "bloom", "mpt", "opt", "opt-350m", "gpt-neo", "codegen", "persimmon",
                   "biogpt", "xglm", "gpt-neox-japanese", "ctrl", "openai-gpt", *SEQ2SEQ_DECODER_KINDS)
LAYER_NORM_EPS = 1e-3
# GLM-4.7-Flash (glm4-moe-lite): V3's model with layer 0 dense by mlp_layer_types, a shared expert.
DEEPSEEK_KINDS = ("deepseek-v2", "deepseek-v2-group", "deepseek-v3", "glm4-moe-lite")
# MLA beyond DeepSeek's routers: Youtu-LLM (V3's attention, dense MLPs on every layer, tied); A.X-K1 (axk1): V3 as
# "deepseek-v3" with an RMSNorm on the output of each MoE.
MLA_KINDS = ("youtu", "axk1")
# More Llama-like families. OLMo: parameter-free LayerNorms, q/k/v clamped (clip_qkv, below many of the test model's
# values). EXAONE 4: norms after the sublayers, per-head q/k norms, sliding layers with rope and a global one without.
# Seed-OSS: q/k/v and MLP biases, none on o_proj. Helium: interleaved rope, q/k/v biases, fp32-weight RMSNorms.
# Arcee: a non-gated relu^2 MLP. Nemotron: the same MLP, LayerNorm1P (1 + weight) norms, half of each head rotated.
# ERNIE 4.5: interleaved rope, biases on q/k/v/o and the MLP. Hunyuan: per-head q/k norms after rope, NTK-alpha rope.
# Apertus: per-head q/k norms, a non-gated MLP with xIELU (learned parameters per layer), q/k/v/o biases.
# CWM: Llama with windows on the layers layer_types marks, llama3 rope. Jais 2: Nemotron's layer with plain LayerNorms
# (biases), the relu^2 MLP with biases, q/k/v/o biases, rope over the whole head. Mllama's text model (mllama): llama3
# rope, GQA, a cross-attention layer 1 (in the checkpoint, skipped without images), 8 embedding rows past the
# vocabulary, untied. Emu3's text model (emu3): Llama's layers.
# Chameleon (chameleon: norms before the sublayers, GQA, q/k/v/o biases; chameleon-swin: `swin_norm`, norms after
# them, one KV head, MLP biases): a LayerNorm of each head's own (weight and bias) on queries and keys, the image tokens
# (CHAMELEON_IMAGE_TOKENS, a quarter of the vocabulary, where the unsuppressed argmax falls at some steps) suppressed in
# the logits; its VQ model, tiny (CHAMELEON_VQ), saved for the loader to skip; rms_norm_eps (CHAMELEON_RMS_NORM_EPS) far
# from the q/k norms' fixed 1e-5, so that either at the other's shows.
CHAMELEON_KINDS = ("chameleon", "chameleon-swin")
CHAMELEON_IMAGE_TOKENS = tuple(range(256, 384))
CHAMELEON_VQ = dict(embed_dim=4, num_embeddings=len(CHAMELEON_IMAGE_TOKENS), latent_channels=4, base_channels=32,
                    channel_multiplier=[1], num_res_blocks=1, resolution=8)
CHAMELEON_RMS_NORM_EPS = 1e-2
DENSE_KINDS = ("olmo", "exaone4", "seed-oss", "helium", "arcee", "nemotron", "ernie4_5", "hunyuan", "apertus", "cwm",
               "jais2", "nanochat", "mllama", "emu3", *CHAMELEON_KINDS)
# Hybrids of attention with recurrent layers (see ssm_config): LFM2 (short convolutions), Bamba and Granite 4.0-H
# (Mamba2; Granite's MoE with a shared MLP and rope, or its dense MLP without position encoding).
# LFM2-MoE: LFM2's layers, layer 0's MLP dense, then 2 of 8 experts (sigmoid, a random expert_bias, renormalized,
# scaled).
# RecurrentGemma (recurrent-gemma): RG-LRU layers 0 and 1 (slow decays on some channels; lru_width = hidden_size, as
# in the checkpoints: transformers sizes its conv state by hidden_size) and a local attention layer 2
# (RECURRENT_GEMMA_WINDOW, one KV head, q/k/v biases), the logits soft-capped below their size.
# RWKV-4 (rwkv): 4 blocks, rescale_every 2 (the stream halved after blocks 1 and 3), RWKV_LAYER_NORM_EPS, decays from
# none to fast, attention-free.
SSM_KINDS = ("lfm2", "bamba", "granitemoehybrid", "granitemoehybrid-dense", "lfm2-moe", "recurrent-gemma", "rwkv")
RECURRENT_GEMMA_WINDOW = 10
# RWKV's LayerNorm epsilon: near the stream's variance (~0.04 here), so that a missing halving (rescale_every), which a
# LayerNorm would otherwise undo, shows.
RWKV_LAYER_NORM_EPS = 1e-2
# NemotronH (one block per layer: Mamba2, attention without rope, relu^2 MLP, relu^2 experts) and Falcon-H1 (attention
# and Mamba2 side by side in every layer, every muP multiplier away from 1): see mamba2_hybrid_config.
# Zamba2: Mamba2 layers and hybrid layers invoking 2 shared attention + MLP blocks in rotation (3 invocations: the
# first block twice, the first one before any Mamba2 layer), each with its own LoRA adapters, KV cache and linear;
# rope, projection biases, GeLU. And Mamba2 alone (no attention, no MLP).
MAMBA2_HYBRID_KINDS = ("nemotron-h", "falcon-h1", "falcon-h1-norm", "zamba2", "mamba2")
# Gemma 4 (see gemma4_config): sliding and full layers, the full ones with wider heads, one KV head and a rope turning
# a quarter of their frequencies; "gemma4" with values from the key projection (attention_k_eq_v), "gemma4-moe" with
# its own value projection and 2 of 4 experts beside the dense MLP in every layer, "gemma4-e" as E2B/E4B: per-layer
# embeddings, and its last two layers (twice as wide MLPs) reusing the keys and values of layers 2 and 3;
# "gemma4-unified" (Gemma 4 unified's text model, a config without per-layer embeddings or experts) as "gemma4-e"
# without per-layer embeddings, values from the key projection on its full layers.
GEMMA4_KINDS = ("gemma4", "gemma4-moe", "gemma4-e", "gemma4-unified")
# Gemma 3n (see gemma3n_config): Gemma 4 E-style attention and per-layer inputs (a table shorter than the vocabulary
# where transformers maps the ids past it: prompt ids from 400 take its row 0) inside AltUp's 4 streams, LAuReL, activation sparsity on layers 0 and 1 (0.95,
# 0.6), MLPs of two widths, and its last two layers reusing the keys and values of layers 2 and 3.
GEMMA3N_KIND = "gemma3n"
# GPT-OSS: attention sinks (GPT_OSS_SINK_STD, so that they weigh), sliding and full layers, yarn rope, q/k/v/o biases,
# 2 of 8 experts per token by a biased router, experts with biases whose gate/up weights (GPT_OSS_GATE_UP_STD) push
# the SwiGLU into its clamps.
# Ministral: Mistral's attention windowed by layer_types (layer 1 full). Ministral 3: a window on every layer, yarn,
# and queries scaled by position (Llama 4's temperature) with a short period, so the test prompts cross several.
MISTRAL_KINDS = ("mistral", "ministral", "ministral3")
EXTRA_KINDS = (("qwen3-moe", "qwen2-swa", "qwen3-swa") + MISTRAL_KINDS + QWEN3_NEXT_KINDS + SSM_KINDS
               + MAMBA2_HYBRID_KINDS
               + ("gemma3", "gemma2", "gemma", "phi3", "granite", "smollm3", "olmo2", "olmo3", "glm4", "glm")
               + ("granite-swa", "granitemoe-swa") + GEMMA4_KINDS + (GEMMA3N_KIND,)
               + ("mixtral", "qwen2-moe", "granitemoe", "granitemoe-shared", "olmoe", "glm4-moe", "dots1",
                  "ernie4.5-moe", "hunyuan-moe", "llama4", "phimoe", "flexolmo", "exaone-moe", "dbrx")
               + ("vaultgemma",)
               + LAYERNORM_KINDS + DEEPSEEK_KINDS + DENSE_KINDS + ("gpt-oss",)
               + ("solar-open", "minimax-m2", "cohere2-moe", "cohere2-moe-sigmoid") + MLA_KINDS)
# BERT-style models as decoders (BERT_DECODER_KINDS, bert_decoder_config: is_decoder, causal), every LayerNorm at
# LAYER_NORM_EPS, tied decoders with biases: BERT (bert-lmhead): post-LN layers, token type 0, the prediction head's
# activation the config's "gelu_new"; ERNIE (ernie-lmhead): BERT's with ERNIE's task type 0 (use_task_id);
# BertGeneration (bert-generation-lmhead): no token types, no prediction head; ELECTRA (electra-lmhead): embeddings
# narrower than the layers (embedding_size), projected, its generator head as narrow, ReLU layers under its fixed GeLU;
# RoBERTa (roberta-lmhead): positions from pad_token_id + 1 (2 + 1 here), ReLU layers under the head's fixed GeLU;
# XLM-RoBERTa, CamemBERT and Data2Vec-Text (xlm-roberta-lmhead, camembert-lmhead, data2vec-text-lmhead): RoBERTa's model
# under their own classes; RoBERTa-PreLayerNorm (roberta-prelayernorm-lmhead): pre-LN layers, a final LayerNorm;
# XLM-RoBERTa-XL (xlm-roberta-xl-lmhead) and Megatron-BERT (megatron-bert-lmhead): pre-LN, embeddings without a
# LayerNorm, RoBERTa's and BERT's positions; BigBird (big-bird-lmhead): BERT's with full attention, no q/k/v biases
# (use_bias), word embeddings scaled (rescale_embeddings); RemBERT (rembert-lmhead): embeddings 32 wide projected in, a
# head 48 wide, untied; X-MOD (xmod-lmhead): RoBERTa's with two languages' adapters 32 wide, the second the default;
# RoCBert (roc-bert-lmhead): BERT's with the shape and pronunciation embeddings of id 0 joined to the word embeddings
# and mapped back (concat_input); RoFormer (roformer-lmhead): rope on interleaved pairs, no position embeddings (its
# sinusoid table as transformers computes it), embeddings 32 wide projected in.
BERT_DECODER_KINDS = ("bert-lmhead", "ernie-lmhead", "bert-generation-lmhead", "electra-lmhead", "roberta-lmhead",
                      "xlm-roberta-lmhead", "camembert-lmhead", "data2vec-text-lmhead", "roberta-prelayernorm-lmhead",
                      "xlm-roberta-xl-lmhead", "megatron-bert-lmhead", "big-bird-lmhead", "rembert-lmhead",
                      "xmod-lmhead", "roc-bert-lmhead", "roformer-lmhead")
EXTRA_KINDS += BERT_DECODER_KINDS
# Mamba-1 mixers (see mamba1_config): Mamba (projection biases, tied), Falcon-Mamba (weightless dt/B/C norms, untied),
# Jamba (dt/B/C norms with weights; attention without rope on layer 2; 2 of 4 experts on layers 1 and 3, dense MLPs
# on 0 and 2).
MAMBA1_KINDS = ("mamba", "falcon-mamba", "jamba", "zamba")
EXTRA_KINDS += MAMBA1_KINDS
# xLSTM: mLSTM blocks (a matrix memory per head, queries and keys half as wide as values, as xLSTM-7b's) and gated
# MLPs, no attention; transformers' chunk_size above every test prompt, so that its reference is the one-step
# recurrence throughout (its chunkwise form at xLSTM-7b's chunk_size 64 is the same sums reordered, 2e-5 from it at
# these logits; the engine's block form against the recurrence over many blocks: test_ssm), gate and logit soft caps
# low enough to bend them, forget gates biased towards remembering (XLSTM_FORGET_BIAS), as trained ones are, so the
# state carries far.
XLSTM_KIND = "xlstm"
XLSTM_FORGET_BIAS = 3.0
EXTRA_KINDS += (XLSTM_KIND,)
# The newest transformers families (see newest_family_config), each with transformers' module name: where the
# installed transformers lacks it (5.17, the GPU machine's, lacks some), its tests skip (conftest's model_dir).
# AFMoE (afmoe): per-head q/k norms, a sigmoid output gate, sliding layers 0 and 2 with rope and a full NoPE layer 1,
# four norms per layer, muP's embedding scale, q/k/v/o biases; layer 0 dense, then 2 of 8 experts (sigmoid, a random
# expert_bias, renormalized, route_scale) plus a shared expert.
# Mellum: Qwen3-MoE's attention (q/k/v/o biases) on sliding layers 0 and 2 and a full layer 1 with another rope base,
# layer 0's MLP dense, then 2 of 8 experts (softmax, renormalized). HY3 (hy-v3): per-head q/k norms, q/k/v/o and MLP
# biases, layer 0 dense, then 2 of 8 experts (sigmoid, a random correction bias, renormalized, scaled) plus a shared
# expert. Laguna: 4, 6 and 2 query heads on its layers (2 KV heads), a softplus gate per head, sliding layers 0 and 2
# and a full layer 1 with its own rope over half of each head, q/k/v/o biases; layer 0 dense, then 2 of 8 experts
# (sigmoid of router logits softcapped below their size, a random correction bias, renormalized, scaled) plus a
# shared expert.
# Flint: GPT-OSS's sinks (GPT_OSS_SINK_STD) and norms, per-head q/k norms, sliding layers 0 and 2 with rope and a full
# NoPE layer 1, q/k/v/o biases; layer 0 dense (mlp_only_layers), then 2 of 8 experts (sigmoid, renormalized) plus a
# shared expert.
# Kolibri-1 (kolibri1): EXAONE 4's attention (sliding layers 0 and 2 with rope, a full NoPE layer 1) in GLM-4's
# four-norm layer, 2 of 8 experts on every layer (the top router logits plus a random correction bias, weighted by
# their sigmoid, renormalized) plus a shared expert.
# Kolibri 1.1 (kolibri1-1): Kolibri-1's layer with indexed NoPE layers 0, 2 and 3 around a sliding layer 1 (rope),
# layers 2 and 3 attending over layer 0's keys and values, all rounded to NVFP4. The indexers of layers 0 and 3 pool
# each query's best KOLIBRI11_POOL keys in blocks of KOLIBRI11_BLOCK, layer 2 rescores layer 0's pool; each query keeps
# 2 sinks, its last 4 tokens and the KOLIBRI11_TOPK best keys of its pool (2 index heads): most test contexts hold more
# than either. Layer 0's MLP dense, then Kolibri-1's experts.
KOLIBRI11_BLOCK, KOLIBRI11_POOL, KOLIBRI11_TOPK = 4, 16, 6
# JetMoE (jetmoe): its mixture of attention heads (2 of 8 experts' query and output projections over 2 shared KV
# heads, an output bias) and MoE MLP (2 of 8 experts, a bias) on every layer; rms_norm_eps 1e-5 for the final norm
# (the layers' stay at 1e-6, as transformers').
# LFM3: LFM2's short convolutions (layers 0 and 2) with a sliding attention layer 1 and a full one 3 with its own
# (proportional) rope over half of each head, sandwich norms, a sigmoid output gate per head, q/k/v/o biases.
# OLMo Hybrid (olmo-hybrid): Gated DeltaNet layers 0 and 2 (q, k, v and their convs stored apart, beta doubled) around
# OLMo 3's post-norm attention layer 1 (whole-projection q/k norms, q/k/v/o biases).
# DeepSeek-V3.2 (deepseek-v32): "axk1"'s MLA and MoE with DeepSeek sparse attention, an indexer of 16 heads keeping
# each query's DSA_TOPK best keys (fewer than most test prompts hold); "deepseek-v32-wide" keeps DSA_WIDE_TOPK, more
# than any test context (dense attention). GLM-MoE-DSA (glm-moe-dsa): its indexer ropes interleaved pairs, layer 1
# reuses layer 0's selection. A.X-K2 (axk2): "deepseek-v32" with its output gate, gated norms and ungrouped routing.
# dots3 note's text model (dots3-note): indexed layers 0 and 2 as "glm-moe-dsa"'s, a sliding layer 1 (DOTS3_WINDOW) of
# its own MLA widths (2 heads of 24 + 8 over a latent of 24, values 8 wide), each layer type its rope base; every MLA
# with LoRA scales, a normed rope key and a sigmoid gate per head; layer 0 dense, then V3's MoE (2 of 8 experts in the
# best 2 of 4 groups) plus a shared expert 24 wide; its latent and rope-key norms at the config's epsilon
# (DSA_RMS_NORM_EPS), its indexer's key norm at 1e-6.
DOTS3_WINDOW = 10
# MiniMax-M3's text model (minimax-m3): a full layer 0 and block-sparse layers 1 and 2 (an indexer head per KV head, 2;
# blocks of MINIMAX_M3_BLOCK positions, each query keeping 3 of them, its own and the one before always), Gemma norms
# (per-head q/k ones too, the indexer's), rope over half of each head; layer 0's MLP dense, then 2 of 8 experts
# (sigmoid + a random correction bias, renormalized, scaled) plus a shared expert, all with GPT-OSS's clamped SwiGLU.
MINIMAX_M3_BLOCK = 4
DSA_TOPK, DSA_WIDE_TOPK = 6, 512
# HY-V4's and dots3 note's rms_norm_eps, near the mean squares it is added to: their norms take the config's epsilon
# or transformers' default 1e-6 each its own way, and one at the other's fails their tests.
DSA_RMS_NORM_EPS = 0.1
# HY-V4 (hy-v4): "glm-moe-dsa"'s layout (rope on interleaved pairs), the indexer's rope over the last 8 of its 16 dims,
# GPT-OSS's sinks (GPT_OSS_SINK_STD), a sigmoid output gate per element, 3 hyper-connection streams (their weights
# random, hc_magnitude 1.5), routed experts' gate/up at GPT-OSS's scale so that the clamps at HY_V4_SWIGLU_LIMIT bind;
# its indexer's key norm at the config's epsilon (DSA_RMS_NORM_EPS), its latent norms at transformers' default 1e-6.
HY_V4_SWIGLU_LIMIT = 4.0
# DeepSeek-V4 (deepseek-v4): a sliding layer 0 (window DSV4_WINDOW), a CSA layer 1 (overlapping windows of 4, an indexer
# of 8 heads keeping DSV4_INDEX_TOPK entries, fewer than most test contexts hold) and an HCA layer 2 (windows of 8); 4
# heads of 32 (the last 8 roped) on one shared K = V head, sinks (GPT_OSS_SINK_STD), outputs in 2 groups of 16; a
# yarn-scaled rope on the compressed layers, the plain one on the sliding layer; 3 hyper-connection streams (2 Sinkhorn
# iterations, short of converging: their count shows; hc_eps 1e-3); every MLP 2 of 8 experts plus a shared one, clamped
# at DSV4_SWIGLU_LIMIT (gate/up at GPT-OSS's scale, so that the clamps bind), hash-routed on layer 0 (a random table),
# then by sqrt(softplus) + a random correction bias.
DSV4_WINDOW, DSV4_INDEX_TOPK, DSV4_SWIGLU_LIMIT = 10, 3, 4.0
# Inkling (inkling): relative logits (a bias per query and backward distance) on sliding layers 0 and 2 (6 heads of 8
# on 2 KV heads, biased over their whole window) and a full layer 1 (4 heads of 16, biased up to INKLING_REL_EXTENT
# back, queries and biases scaled by log(position) from 8 on), short convs on keys, values and both sublayers' outputs, a
# normed embedding; layer 0's MLP dense, then 2 of 8 experts (sigmoid, a random correction bias) and 2 shared experts
# weighted by one softmax over their log-sigmoids; every global_scale away from 1; the logits over a muP multiplier.
INKLING_SLIDING_WINDOW, INKLING_REL_EXTENT = 10, 12
# Inkling-2 (inkling2): Inkling's layer pattern (sliding 0 and 2, full 1) with blocks of 2 layers (layers 0 and 2 close
# one), so that every layer input but the first, every MLP input and the final one is a softmax over 2 or 3 depths
# (their queries of std 1); a sink logit per query and head, an output gate; clip thresholds that some queries, keys
# and relative states exceed (their scales 1 + noise); dynamic key/value convs on layer 1; 2 of 8 experts (a random
# correction bias), softcaps low enough to bend their gate and up values and the logits.
INKLING2_CLIPS = dict(qk_l2_clip_threshold=1.5, rel_l2_clip_threshold=0.3)
# Inkling-2-Loop (inkling2-loop): Inkling-2's kind over 4 layers (sliding and full in turn), each closing a block, the
# full layer 1 and the sliding layer 2 looped INKLING2_LOOP_PASSES times, so that every message (low-rank gates, 8) is
# a softmax over 2 depths (the pass's second block and its final state). The loop makes the model 8 layers deep, and
# fp32 rounding (transformers' as the engine's) grows with depth: its depth-softmax queries (of
# INKLING2_LOOP_QUERY_STD), route_scale and message gates' down_proj (INKLING2_LOOP_GATE_DOWN_STD: the gates' tanh
# inputs of std ~0.6) are lower than Inkling-2's kind's: at those, transformers' own fp32 logits stray up to 3e-4 from
# its fp64 ones (at these, 2e-5).
INKLING2_LOOP_PASSES, INKLING2_LOOP_QUERY_STD, INKLING2_LOOP_ROUTE_SCALE = 3, 0.5, 1.0
INKLING2_LOOP_GATE_DOWN_STD = 0.1
# Kimi Linear (kimi-linear): KDA layers 0 and 2 (a decay per key channel, slow on some channels so that the state
# carries across chunks) around an MLA layer 1 without rope (the low-rank q), layer 0's MLP dense, then V3's MoE
# (2 of 8 experts in the best 2 of 4 groups, a random correction bias, renormalized, scaled) plus a shared expert.
# Ling's hybrid (bailing-hybrid): Kimi Linear's layout with Ling's KDA (full-rank gates, the bounded decay: head rates
# e^A_log from 1 to 16, so that some channels barely decay and some decay fast) and MLA (q at full rank, interleaved
# rope, a sigmoid gate per head on the output), V3's MoE (2 of 8 experts in the best 2 of 4 groups, a random
# correction bias, renormalized, scaled) plus a shared expert after a dense layer 0.
# ZAYA (zaya): CCA attention (q/k convs of 2 and 3 taps, values half from the token before), full layers 0 and 2 with
# one rope and a sliding layer 1 with another (half of each head rotated), q/k/v/o biases, key temperatures and
# residual scales near 1; its router over 4 experts and the skip class (chosen for a few tokens: see
# ZAYA_SKIP_LOGIT_SCALE), an lm_head bias, tied embeddings.
# MiniMax (minimax): lightning attention layers 0 and 2 (heads decaying from fast to slow, almost none on the last
# layer) around a softmax attention layer 1, 2 of 8 experts on every layer, every residual factor away from
# 1; transformers' lightning blocks (block_size) shorter than the prompts.
# MiMo-V2-Flash (mimo-v2-flash): sliding layers 0 and 2 with two KV heads and sinks (GPT_OSS_SINK_STD), a full layer 1
# with one, each type with its rope base and rotated share (the default 0.334, 0.5), values narrower than the keys
# (16 against 24) scaled by 0.6, q/k/v biases; layer 0 dense, then 2 of 8 experts (sigmoid, a random correction bias,
# 2 of 4 groups, renormalized, scaled), no shared expert.
# LongCat-Flash (longcat-flash): 2 layers of two MLA sublayers each (low-rank q, V narrower than K: 16 against 16 + 8,
# the queries and latents scaled by their LoRA ranks), each followed by a dense MLP, and a shortcut MoE per layer: 3 of
# 8 real experts and 4 zero (identity) ones by softmax + a random correction bias, not renormalized, scaled.
# Doge: per-head q/k norms, the dynamic mask's key bias (A of std DOGE_A_STD, so that it varies by key), residual
# scales near 1, q/k/v/o and MLP biases, one KV head per two query heads.
# Dense variants (NEWEST_DENSE_KINDS, tested with the dense families: test_correctness.py, test_families.py):
# HyperCLOVAX (hyperclovax): Granite's multipliers (each away from 1) with a norm on each sublayer's output
# (use_post_norm) and the logits multiplied by logits_scaling. BitNet: the unquantized layout, RMSNorms over the
# attention output and the MLP's gated activations (attn_sub_norm, ffn_sub_norm), relu2. MiniCPM3: DeepSeek's MLA
# (low-rank q, V narrower than K) with rotate-half rope, embeddings times scale_emb, sublayers times
# scale_depth / sqrt(layers), logits over hidden_size / dim_model_base (2). DiffLlama: differential attention, 8 query
# heads on 4 KV heads (two pairs of value heads, two query heads per KV head), lambda_init growing by layer. HRM-Text
# (hrm-text): two stacks of 2 gated-attention layers, 2 high-level cycles of 2 low-level runs each.
# Aria's language model (aria-text): Llama's attention (q/k/v/o biases), every MLP 2 of 8 SiLU experts stacked [in,
# out] (a softmax over the chosen logits) plus two shared experts as one MLP twice as wide (biases, mlp_bias).
# Cohere Compass's text model (cohere-compass): Cohere 2's parallel layer with rope in the neox layout (not Cohere's
# interleaved one) on the sliding layers 0 and 2, a full NoPE layer 1, q/k/v/o biases, logit_scale.
# Beam: Qwen3-MoE's attention with per-head q/k norms, an output gate per element with a bias per head, q/k/v/o
# biases, sliding layers 0 and 2 with rope and a full NoPE layer 1 (queries scaled by position), four norms per layer
# and depth-scaled residual adds (see BEAM_RMS_NORM_EPS); layer 0 dense, then 2 of 8 experts (sigmoid, a random
# correction bias, 2 of 4 groups, renormalized, scaled), no shared expert; final-logit softcapping below the logits.
# Beam's epsilon: the n-th depth-scaled add leaves the stream 1/sqrt(n) times the plain sum, which the pre-norms undo
# but for their epsilon; at 1e-2 (against mean squares of ~0.01-1) a missing scale shows.
BEAM_RMS_NORM_EPS = 1e-2
# ModernBERT's decoder (modernbert-decoder): ModernBERT's layers (norm biases, the first attention norm an identity,
# the embeddings' norm, a GeGLU MLP), causal, with a window of local_attention // 2 on its sliding layers 1 and 2 and
# its own rope base per layer type, every bias on, the prediction head (dense, GeLU, LayerNorm) before the tied decoder
# with its bias.
# Qwen4-Exp (qwen4-exp): Qwen3.5-MoE's layers (linear, attention, linear; 2 of 8 experts plus the gated shared expert)
# in 3 hyper-connection streams; QSA on the attention layer with blocks of 4 and a budget of 8 tokens (2 blocks: most
# prompts have many more), its rope over a quarter of the heads; PLE on layers 1 and 3 (one-based) with 2- and 3-gram
# tables of 2 heads each (primes from 53, saved in 2 parts), a sigmoid output gate on the delta rule.
# Apertus 1.5's text model (apertus1.5): Apertus with its LM head pruned to the vocabulary's first 448 ids.
# MiniCPM5-MoE (minicpm5-moe): Llama's attention with q/k/v/o biases and a per-head output gate from q_gate_proj;
# layer 0 dense, then 2 of 8 experts (sigmoid, a random correction bias, 2 of 4 groups, renormalized, scaled) plus a
# shared expert.
# Dory (dory): a sliding input layer, a full and a sliding recurrent layer run DORY_LOOPS times (a KV cache per run),
# a full output layer, each layer type its rope base; q/k/v/o and MLP biases; nGPT's scales at transformers' initial
# values times 1 + noise (of random sign where transformers squares them or takes their magnitude), the residual rates
# near DORY_ALPHA_INIT (transformers' 0.05 would barely move the states), the logit scales near DORY_LOGIT_SCALE times
# their initial value (at it, logits of the unit-norm states spread over ~0.2).
DORY_LOOPS, DORY_ALPHA_INIT, DORY_LOGIT_SCALE = 3, 0.5, 15.0
# Lara Mini (lara-mini): Qwen3.5's Gated DeltaNet (2 key heads, 4 value heads 24 wide; its projections fused in one
# in_proj, its gated norm out_norm, as the Hub's) on layer 0, then Qwen3's attention (per-head q/k norms, q/k/v/o
# biases) on a sliding layer 1 with rope (LARA_MINI_SLIDING_WINDOW) and a full NoPE layer 2; every MLP 2 of 8 experts
# (fp32 softmax router, renormalized) plus an ungated shared expert.
# Ergo (ergo): a fused qkv_proj, per-head q/k norms, rope on interleaved pairs on the sliding layers 0 and 2, a full
# NoPE layer 1 whose queries and keys are scaled by sqrt(global_attention_scale); four norms per layer, each sublayer's
# output mixed into the residual stream by a learned gate per dimension; relu^2 MLPs: layer 0 dense, then 2 of 8
# experts (sigmoid, a random correction bias, renormalized, scaled), each expert's output RMS-normed with its own
# weight, plus a shared expert with its own norm.
# Phi-4-multimodal's language model (phi4-multimodal): the "phi3" kind's shape (GQA, 3/4 of each head rotated, longrope
# switching to its long factors past PHI3_ORIGINAL_MAX_POSITION, a window on every layer) with tied embeddings, as the
# Hub's; its image and audio towers (one layer each, unused on text) saved beside it, for the loader to skip.
# Mistral 4 (mistral4): DeepSeek-V3's MLA (low-rank q, V narrower than K: 16 against 16 + 8, interleaved rope, biases
# on q_a/kv_a/o) with yarn rope (distinct mscale / mscale_all_dim) whose queries are scaled by position past
# original_max_position_embeddings (16, below most prompts' lengths); layer 0 dense, then 3 of 8 experts by softmax
# within the best 2 of 4 groups, renormalized and scaled, plus a shared expert.
NEWEST_FAMILIES = {"afmoe": "afmoe", "mellum": "mellum", "hy-v3": "hy_v3", "laguna": "laguna", "flint": "flint",
                   "kolibri1": "kolibri1", "lfm3": "lfm3", "olmo-hybrid": "olmo_hybrid", "deepseek-v32": "deepseek_v32",
                   "deepseek-v32-wide": "deepseek_v32", "glm-moe-dsa": "glm_moe_dsa", "axk2": "axk2",
                   "dots3-note": "dots3_note", "minimax-m3": "minimax_m3_vl", "kimi-linear": "kimi_linear",
                   "bailing-hybrid": "bailing_hybrid", "zaya": "zaya", "minimax": "minimax", "mimo-v2-flash": "mimo_v2_flash",
                   "longcat-flash": "longcat_flash", "doge": "doge", "hyperclovax": "hyperclovax", "bitnet": "bitnet",
                   "minicpm3": "minicpm3", "diffllama": "diffllama", "hrm-text": "hrm_text", "jetmoe": "jetmoe",
                   "inkling": "inkling", "aria-text": "aria", "beam": "beam", "cohere-compass": "cohere_compass",
                   "modernbert-decoder": "modernbert_decoder", "hy-v4": "hy_v4", "inkling2": "inkling2",
                   "qwen4-exp": "qwen4_exp", "deepseek-v4": "deepseek_v4", "minicpm5-moe": "minicpm5_moe",
                   "apertus1.5": "apertus1p5", "dory": "dory", "lara-mini": "lara_mini",
                   "kolibri1-1": "kolibri1_1", "ergo": "ergo", "phi4-multimodal": "phi4_multimodal",
                   "mistral4": "mistral4", "inkling2-loop": "inkling2_loop"}
NEWEST_KINDS = tuple(NEWEST_FAMILIES)
NEWEST_HYBRID_KINDS = ("lfm3", "olmo-hybrid", "kimi-linear", "bailing-hybrid", "zaya", "minimax",  # as the other
                       "inkling", "inkling2", "qwen4-exp", "lara-mini", "inkling2-loop")  # hybrids (test_ssm.py)
NEWEST_DENSE_KINDS = ("doge", "hyperclovax", "bitnet", "minicpm3", "diffllama", "hrm-text", "cohere-compass",
                      "modernbert-decoder", "apertus1.5", "dory", "phi4-multimodal")
NEWEST_MOE_KINDS = tuple(kind for kind in NEWEST_KINDS  # as the MoEs (test_moe.py)
                         if kind not in NEWEST_HYBRID_KINDS + NEWEST_DENSE_KINDS)
EXTRA_KINDS += NEWEST_KINDS
# DBRX: q/k/v clamped to +-DBRX_CLIP_QKV (a sixth of layer 0's are beyond it), GQA, 2 of 8 experts on every layer,
# their weights divided by their DBRX_NORM_P-norm (DBRX's own is 1, a plain renormalization: 2 tells them apart).
DBRX_CLIP_QKV = 0.5
DBRX_NORM_P = 2.0
# Sliding windows: shorter than most test prompts.
SLIDING_WINDOW = {"qwen2-swa": 12, "qwen3-swa": 9, "mistral": 20, "ministral": 13, "ministral3": 15, "gemma3": 10,
                  "gemma2": 11, "gemma4": 10, GEMMA3N_KIND: 10, "phi3": 24, "smollm3": 11, "olmo3": 11, "mixtral": 14,
                  "starcoder2": 13, "exaone4": 10, "cohere2": 12, "dots1": 12, "gpt-oss": 12, "phimoe": 22,
                  "vaultgemma": 11, "exaone-moe": 10, "granite-swa": 11, "granitemoe-swa": 13, "gpt-neo": 11, "cwm": 12,
                  "cohere2-moe": 11, "cohere2-moe-sigmoid": 12, "afmoe": 10, "mellum": 12,
                  "laguna": 11, "flint": 12, "kolibri1": 10, "mimo-v2-flash": 11, "cohere-compass": 11,
                  "beam": 10, "modernbert-decoder": 10, "dory": 10, "kolibri1-1": 10, "ergo": 10,
                  "phi4-multimodal": 22}
LLAMA4_CHUNK = 12  # Llama 4's attention_chunk_size in the test model
# LFM3's, ZAYA's and Lara Mini's windows, apart from SLIDING_WINDOW (whose test takes prefix cache hits, which hybrids
# refuse).
LFM3_SLIDING_WINDOW = 10
ZAYA_SLIDING_WINDOW = 10
LARA_MINI_SLIDING_WINDOW = 11
# gemma2's attention-logit softcap: below the scores of the test weights (several exceed it), so the tanh shows.
GEMMA2_ATTN_SOFTCAP = 6.0
# phi3's longrope: short factors up to this length, long ones beyond; the test prompts fit in it, and their
# continuations cross it.
PHI3_ORIGINAL_MAX_POSITION = 80
ALL_KINDS = MODEL_KINDS + ("qwen3-sharded",) + EXTRA_KINDS
# The mixture-of-experts kinds whose decode CUDA graphs capture in bf16 on sm90 (fused_moe.experts_capturable): those
# without recurrent state or per-step host state (test_cuda_audit checks each one's model).
GRAPH_MOE_KINDS = ("qwen3-moe", "granitemoe-swa", "gemma4-moe", "mixtral", "qwen2-moe", "granitemoe",
                   "granitemoe-shared", "olmoe", "glm4-moe", "dots1", "ernie4.5-moe", "hunyuan-moe", "llama4", "phimoe",
                   "flexolmo", "exaone-moe", "dbrx", "deepseek-v2", "deepseek-v2-group", "deepseek-v3", "glm4-moe-lite",
                   "gpt-oss", "solar-open", "minimax-m2", "cohere2-moe", "cohere2-moe-sigmoid", "axk1", "afmoe",
                   "mellum", "hy-v3", "laguna", "flint", "kolibri1", "mimo-v2-flash", "longcat-flash", "jetmoe",
                   "aria-text", "beam", "minicpm5-moe", "ergo", "mistral4")
# The kinds with recurrent state (linear attention, state-space layers, convolutions), whose decode CUDA graphs read
# each sequence's state slot from a static buffer (those with experts too: in bf16 on sm90).
GRAPH_RECURRENT_KINDS = ("qwen3-next", "qwen3.5", "qwen3.5-moe", "lfm2", "bamba", "granitemoehybrid",
                         "granitemoehybrid-dense", "lfm2-moe", "recurrent-gemma", "rwkv", "nemotron-h", "falcon-h1",
                         "falcon-h1-norm", "zamba2", "mamba2", "mamba", "falcon-mamba", "jamba", "zamba", "xlstm",
                         "lfm3", "olmo-hybrid", "kimi-linear", "bailing-hybrid", "zaya", "minimax", "lara-mini")
# For tensor parallelism: a vocabulary that 2 ranks cannot split evenly (padded) and one KV head (replicated).
ODD_KIND = "qwen2-mqa-oddvocab"
# OLMo 2 with one KV head, for tensor parallelism (each rank then holds all of k and of its norm).
OLMO2_MQA_KIND = "olmo2-mqa"

# Std used for linear/embedding init. transformers' default (0.02) gives near-uniform logits
# and near-uniform attention; this spreads logits and sharpens attention (measured in
# tests/test_models_fixture.py).
INIT_STD = 0.2
# Norm weights become 1 + NORM_NOISE * N(0,1) (so a loader that forgets them is caught).
NORM_NOISE = 0.2
# Linear biases (qwen2 q/k/v) become BIAS_STD * N(0,1) (non-zero, so bias loading is tested).
BIAS_STD = 0.1
# GPT-OSS's sink logits, against scores of std ~2.5 here: some heads' sinks take much of the softmax, some little.
GPT_OSS_SINK_STD = 3.0
# GPT-OSS's expert gate/up weights: pre-activations of std ~5, so that the clamps at swiglu_limit (7) often bind.
GPT_OSS_GATE_UP_STD = 0.6
# Zamba's and Zamba2's layer matrices (shared blocks, adapters, linears, Mamba projections and convs): INIT_STD times
# this. At INIT_STD Zamba2's 5 layers of fan-in 128 attention (scaled by (head_dim / 2) ** -0.5) are chaotic:
# transformers' own fp32 logits sit 7e-3 from its fp64 ones; at half, 2e-5. (Zamba's at INIT_STD: ours 3.6e-4 away.)
# HRM-Text's too: its 12 runs of a layer per token at INIT_STD put transformers' fp32 logits 2e-4 from its fp64 ones; at
# half, 3e-6.
ZAMBA2_LAYER_WEIGHT_SCALE = 0.5
SHARD_SIZE = "200KB"
# LongCat-Flash's correction bias, added to softmax probabilities (~1/12 each here, not sigmoids near 1/2): at the others'
# 0.3 it alone would choose the experts.
LONGCAT_CORRECTION_BIAS_STD = 0.03
# ZAYA's router: the experts' balancing biases, added to probabilities of ~1/5, shift the choice among them without
# deciding it; below zero, and the skip class's logits scaled up, the skip (whose bias transformers sets to -1) wins
# for a few tokens (its probability above ~0.7).
ZAYA_BALANCING_BIAS_MEAN, ZAYA_BALANCING_BIAS_STD = -0.3, 0.05
ZAYA_SKIP_LOGIT_SCALE = 16.0
# Doge's dynamic-mask A: key biases exp(A * softplus(dt)) from ~0.2 to ~5 (at INIT_STD they would barely vary).
DOGE_A_STD = 0.5

_COMMON = dict(
    vocab_size=MODEL_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=INIT_STD,
)

_SEEDS = {"qwen3": 1234, "qwen3-untied": 2345, "qwen2": 3456, "llama": 4567, "qwen3-moe": 5678, "qwen2-swa": 6789,
          "qwen3-swa": 7890, "mistral": 8901, "qwen3-next": 6789, "gemma3": 1357, "gemma2": 1470, "gemma": 1581,
          "phi3": 2468, "granite": 3579, "smollm3": 4680, "olmo2": 1470, "olmo3": 2581, OLMO2_MQA_KIND: 3692,
          "mixtral": 3581, "qwen2-moe": 4681, "granitemoe": 5791, "granitemoe-shared": 6802, ODD_KIND: 9012,
          "starcoder2": 7913, "stablelm": 8024, "phi": 9135, "gpt-neox": 1246, "cohere": 2357, "glm4": 3468,
          "glm": 4579, "gpt2": 5680, "deepseek-v2": 6791, "deepseek-v2-group": 7802, "deepseek-v3": 8913,
          "olmo": 1359, "exaone4": 6680, "seed-oss": 7791, "helium": 8802, "arcee": 9913, "nemotron": 1024,
          "ernie4_5": 2135, "falcon": 2246, "falcon-mqa": 3357, "gptj": 4468, "gpt-bigcode": 5579,
          "hunyuan": 3246, "cohere2": 4357, "apertus": 5468, "bloom": 6579, "mpt": 7680,
          "qwen3.5": 9024, "qwen3.5-moe": 1135, "olmoe": 2246, "glm4-moe": 3357, "dots1": 4468, "ernie4.5-moe": 5579,
          "hunyuan-moe": 6680, "gpt-oss": 9024, "llama4": 7135, "gemma4": 2469, "gemma4-moe": 3570,
          "gemma4-e": 4681, GEMMA3N_KIND: 5792, "gemma4-unified": 5793}
_SEEDS |= {"lfm2": 7791, "bamba": 8802, "granitemoehybrid": 9913, "granitemoehybrid-dense": 1124}
_SEEDS |= {"nemotron-h": 2235, "falcon-h1": 3346, "falcon-h1-norm": 4457, "zamba2": 5568, "mamba2": 5568}
_SEEDS |= {"lfm2-moe": 2346, "recurrent-gemma": 3457, "rwkv": 4568}
# Jamba's seed: on the test prompts its routers' 2nd and 3rd experts stay > 1e-4 apart (a near-tie flips the choice
# on rounding, and that token's logits move by ~0.5).
# FlexOLMo's seed: on the test prompts its routers' 2nd and 3rd experts stay >= 1e-5 apart, and every expert is used.
_SEEDS |= {"glm4-moe-lite": 3457, "exaone-moe": 4568, "granite-swa": 5679, "granitemoe-swa": 6780}
_SEEDS |= {"ministral": 6791, "ministral3": 7902, "phimoe": 8013, "flexolmo": 4024, "vaultgemma": 1235}
_SEEDS |= {"mamba": 2137, "falcon-mamba": 3248, "jamba": 4363, "zamba": 5474}
_SEEDS |= {"opt": 6579, "opt-350m": 7680, "gpt-neo": 8791, "codegen": 9802, "persimmon": 1913, "dbrx": 2924}
_SEEDS |= {"cwm": 5474, "jais2": 6585, "solar-open": 7696, "youtu": 8707, "minimax-m2": 9818, "axk1": 1929,
           "nanochat": 2030, "cohere2-moe": 3141, "cohere2-moe-sigmoid": 4252}
_SEEDS |= {"afmoe": 5474, "mellum": 6585, "hy-v3": 7696, "laguna": 8707, "flint": 9818, "kolibri1": 1929,
           "lfm3": 2030, "olmo-hybrid": 3141, "deepseek-v32": 4252, "deepseek-v32-wide": 4252, "glm-moe-dsa": 5363,
           "axk2": 6474, "kimi-linear": 4252, "minimax": 5363, "mimo-v2-flash": 4252, "longcat-flash": 5363,
           "doge": 6474, "dots3-note": 7585, "minimax-m3": 8696, "bailing-hybrid": 7585, "zaya": 8696}
_SEEDS |= {"hyperclovax": 4252, "bitnet": 5363, "minicpm3": 6474, "diffllama": 7585, "hrm-text": 8696,
           "jetmoe": 9707, "inkling": 1818, "inkling2": 2929}
_SEEDS |= {"aria-text": 1357, "beam": 4680, "cohere-compass": 2468, "modernbert-decoder": 3579}
_SEEDS |= {"hy-v4": 4680, XLSTM_KIND: 5791, "qwen4-exp": 5791, "deepseek-v4": 5791}
_SEEDS |= {"biogpt": 9707, "xglm": 1818, "mllama": 2929, "emu3": 3030, "gpt-neox-japanese": 4141}
_SEEDS |= {"chameleon": 7550, "chameleon-swin": 7551}
_SEEDS |= {kind: 7650 + i for i, kind in enumerate(SEQ2SEQ_DECODER_KINDS)}
_SEEDS |= {kind: 7600 + i for i, kind in enumerate(BERT_DECODER_KINDS)}
_SEEDS |= {"ctrl": 5252, "openai-gpt": 6363, "minicpm5-moe": 7474, "apertus1.5": 8585, "dory": 9696,
           "lara-mini": 9696, "kolibri1-1": 9696, "ergo": 9696, "phi4-multimodal": 1357,
           "mistral4": 1746, "inkling2-loop": 9696}


def _token_ids():
    # Fixed by SPECIAL_TOKENS order in the trainer.
    return {t: i for i, t in enumerate(SPECIAL_TOKENS)}


def make_config(kind: str):
    """The transformers config object for `kind` (without building weights)."""
    from transformers import (ApertusConfig, ArceeConfig, BioGptConfig, BloomConfig, CodeGenConfig, Cohere2Config,
                              Cohere2MoeConfig, CohereConfig, DbrxConfig, Dots1Config, Ernie4_5_MoeConfig,
                              Ernie4_5Config, Emu3TextConfig, Exaone4Config, ExaoneMoeConfig, FalconConfig,
                              FlexOlmoConfig, Gemma2Config, Gemma3TextConfig, GemmaConfig, Glm4Config, Glm4MoeConfig,
                              GlmConfig, GPT2Config, GPTBigCodeConfig, GPTJConfig, GPTNeoConfig, GPTNeoXConfig,
                              GPTNeoXJapaneseConfig, GraniteConfig, GraniteMoeConfig, GraniteMoeSharedConfig,
                              GraniteMoeSWAConfig, GraniteSWAConfig, HeliumConfig, HunYuanDenseV1Config,
                              HunYuanMoEV1Config, LlamaConfig, Ministral3Config, MinistralConfig, MistralConfig,
                              MixtralConfig, MllamaTextConfig, MptConfig, NemotronConfig, Olmo2Config, Olmo3Config,
                              OlmoConfig, OlmoeConfig, OPTConfig, PersimmonConfig, Phi3Config, PhiConfig,
                              PhimoeConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig,
                              SeedOssConfig, SmolLM3Config, StableLmConfig, Starcoder2Config, VaultGemmaConfig,
                              XGLMConfig, CTRLConfig, OpenAIGPTConfig, xLSTMConfig)

    ids = _token_ids()
    special = dict(
        bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN]
    )
    if kind in SSM_KINDS:
        return ssm_config(kind, special)
    if kind in MAMBA2_HYBRID_KINDS:
        return mamba2_hybrid_config(kind, special)
    if kind in NEWEST_KINDS:
        return newest_family_config(kind, special)
    if kind in BERT_DECODER_KINDS:
        return bert_decoder_config(kind, special)
    if kind in ("qwen3", "qwen3-sharded"):
        return Qwen3Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # != hidden/heads (16)
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if kind == "qwen3-moe":
        # Layers 0 and 2 route each token to 2 of 8 experts; layer 1 is dense (mlp_only_layers).
        return Qwen3MoeConfig(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if kind == "qwen2-swa":
        # Layer 0 attends to everything; layers >= max_window_layers (1, 2) to the last 12 positions.
        return Qwen2Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW[kind],
            max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    if kind == "qwen3-swa":
        return Qwen3Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW[kind],
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    if kind == "mistral":  # every layer windowed
        return MistralConfig(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=False,
            sliding_window=SLIDING_WINDOW[kind],
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    if kind == "ministral":
        return MinistralConfig(**_COMMON, **special, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               tie_word_embeddings=False, sliding_window=SLIDING_WINDOW[kind],
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "ministral3":
        return Ministral3Config(**_COMMON, **special, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                tie_word_embeddings=False, sliding_window=SLIDING_WINDOW[kind],
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                 "llama_4_scaling_beta": 0.5})
    if kind == "qwen3-untied":
        return Qwen3Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    if kind == "qwen2":
        return Qwen2Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if kind == ODD_KIND:
        return Qwen2Config(
            **{**_COMMON, "vocab_size": 509},
            **special,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    if kind == "llama":
        return LlamaConfig(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind in QWEN3_NEXT_KINDS:
        return qwen3_next_config(kind, special)
    if kind in MAMBA1_KINDS:
        return mamba1_config(kind, special)
    if kind == "gemma":
        return GemmaConfig(
            **{k: v for k, v in _COMMON.items() if k != "hidden_act"},
            **special,
            hidden_act="gelu_pytorch_tanh",
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    gemma = dict(  # Gemma 2, 3 and 4
        **{k: v for k, v in _COMMON.items() if k != "hidden_act"},
        **special,
        hidden_activation="gelu_pytorch_tanh",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        sliding_window=SLIDING_WINDOW.get(kind),
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=5.0,  # below the test models' logits: a forgotten softcap shows
    )
    if kind in GEMMA4_KINDS:
        return gemma4_config(kind, gemma)
    if kind == GEMMA3N_KIND:
        return gemma3n_config(gemma)
    if kind == "gemma3":
        return Gemma3TextConfig(
            **gemma,
            query_pre_attn_scalar=20,  # scores scaled by 20 ** -0.5, not head_dim ** -0.5
            # Local and global ropes differ in base and in scaling (linear, as Gemma 3's larger models).
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
        )
    if kind == "vaultgemma":
        return VaultGemmaConfig(**gemma, query_pre_attn_scalar=24, attn_logit_softcapping=GEMMA2_ATTN_SOFTCAP,
                                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "gemma2":
        return Gemma2Config(
            **gemma,
            query_pre_attn_scalar=24,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            attn_logit_softcapping=GEMMA2_ATTN_SOFTCAP,
        )
    if kind == "phi3":  # Phi-4-mini's shape: GQA, 3/4 of each head rotated, longrope
        return Phi3Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=SLIDING_WINDOW[kind],
            original_max_position_embeddings=PHI3_ORIGINAL_MAX_POSITION,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                             "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]},
        )
    if kind == "granite":
        return GraniteConfig(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            # Each one away from 1 (and the score scale from head_dim ** -0.5), so a forgotten one shows.
            embedding_multiplier=3.0,
            attention_multiplier=0.4,
            residual_multiplier=0.6,
            logits_scaling=2.0,
        )
    if kind in ("granite-swa", "granitemoe-swa"):
        swa = dict(**special, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, embedding_multiplier=3.0,
                   attention_multiplier=0.4, residual_multiplier=0.6, logits_scaling=2.0,
                   sliding_window=SLIDING_WINDOW[kind],
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   layer_rope_theta=[10_000.0, 0, 500_000.0])
        if kind == "granite-swa":
            return GraniteSWAConfig(**_COMMON, **swa)
        return GraniteMoeSWAConfig(**{**_COMMON, "intermediate_size": 32}, **swa, shared_intermediate_size=48,
                                   num_local_experts=8, num_experts_per_tok=2)
    if kind == "smollm3":
        # no_rope_layers [1, 0, 1]: layer 1 has no rope; with use_sliding_window, it is also the windowed layer.
        return SmolLM3Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW[kind],
        )
    if kind == "exaone4":  # the Hub's layout: layer_types from sliding_window_pattern (every 2nd layer global)
        return Exaone4Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            sliding_window=SLIDING_WINDOW[kind],
            sliding_window_pattern=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    if kind == "seed-oss":
        return SeedOssConfig(**_COMMON, **special, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             tie_word_embeddings=False, attention_bias=True, attention_out_bias=False, mlp_bias=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "helium":
        return HeliumConfig(**_COMMON, **special, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            tie_word_embeddings=False, attention_bias=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "arcee":
        return ArceeConfig(**{**_COMMON, "hidden_act": "relu2"}, **special, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "nemotron":  # its epsilon named norm_eps
        return NemotronConfig(**{k: v for k, v in _COMMON.items() if k not in ("rms_norm_eps", "hidden_act")},
                              **special, hidden_act="relu2", norm_eps=LAYER_NORM_EPS, num_attention_heads=4,
                              num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                               "partial_rotary_factor": 0.5})
    if kind == "ernie4_5":
        return Ernie4_5Config(**_COMMON, **special, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              tie_word_embeddings=True, use_bias=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "hunyuan":  # the Hub's NTK-alpha rope (Hunyuan-7B's alpha), attention biases
        return HunYuanDenseV1Config(**_COMMON, **special, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    tie_word_embeddings=True, attention_bias=True,
                                    rope_parameters={"rope_type": "dynamic", "rope_theta": 10_000.0,
                                                     "alpha": 1000.0, "factor": 1.0})
    if kind == "apertus":
        return ApertusConfig(**{**_COMMON, "hidden_act": "xielu"}, **special, num_attention_heads=4,
                             num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "cwm":  # llama3 rope, windows on the layers layer_types marks (not every 4th's pattern)
        from transformers import CwmConfig

        return CwmConfig(**_COMMON, **special, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         tie_word_embeddings=False, sliding_window=SLIDING_WINDOW[kind],
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
    if kind == "jais2":  # its epsilon named layer_norm_eps
        from transformers import Jais2Config

        return Jais2Config(**{k: v for k, v in _COMMON.items() if k not in ("rms_norm_eps", "hidden_act")},
                           **special, hidden_act="relu2", layer_norm_eps=LAYER_NORM_EPS, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "mllama":  # 4 layers, layer 1 cross-attention; llama3 rope with a short original context
        llama3 = dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
        return MllamaTextConfig(**{**_COMMON, "num_hidden_layers": 4}, num_attention_heads=4, num_key_value_heads=2,
                                cross_attention_layers=[1], rope_parameters=llama3, **special)
    if kind == "emu3":
        return Emu3TextConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, **special,
                              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind in CHAMELEON_KINDS:
        return chameleon_config(kind, special)
    if kind == "nanochat":  # attention biases, which NanoChat's checkpoints lack, tested all the same
        from transformers import NanoChatConfig

        return NanoChatConfig(**{**_COMMON, "hidden_act": "relu2"}, **special, num_attention_heads=4,
                              num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True,
                              final_logit_softcapping=5.0,  # below the test models' logits: a forgotten one shows
                              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "olmo":  # no rms_norm_eps: OLMo's LayerNorms have a fixed epsilon
        return OlmoConfig(
            **{k: v for k, v in _COMMON.items() if k != "rms_norm_eps"},
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            attention_bias=True,
            clip_qkv=2.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    if kind in ("olmo2", OLMO2_MQA_KIND):  # q/k/v/o biases, which OLMo 2's checkpoints lack, tested all the same
        return Olmo2Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2 if kind == "olmo2" else 1,
            tie_word_embeddings=False,
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        )
    if kind == "olmo3":  # yarn on the full layer only, as transformers reads OLMo 3's rope_scaling
        return Olmo3Config(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            sliding_window=SLIDING_WINDOW[kind],
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "yarn", "rope_theta": 500_000.0, "factor": 8.0,
                                                "original_max_position_embeddings": 64}},
        )
    if kind in ("glm4", "glm"):
        return (Glm4Config if kind == "glm4" else GlmConfig)(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2 if kind == "glm4" else 1,
            head_dim=32,
            tie_word_embeddings=False,
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                             "partial_rotary_factor": 0.5 if kind == "glm4" else 0.25},
        )
    if kind == "mixtral":
        return MixtralConfig(
            **{**_COMMON, "intermediate_size": 32},  # each expert's
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=SLIDING_WINDOW[kind],
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if kind == "dbrx":  # DbrxConfig's names (d_model, n_heads, n_layers, max_seq_len) and its attn / ffn sub-configs
        return DbrxConfig(vocab_size=MODEL_VOCAB_SIZE, d_model=64, n_heads=4, n_layers=3, max_seq_len=512,
                          attn_config={"kv_n_heads": 2, "clip_qkv": DBRX_CLIP_QKV, "rope_theta": 500_000.0},
                          ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2,
                                      "moe_normalize_expert_weights": DBRX_NORM_P},
                          rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
                          initializer_range=INIT_STD, tie_word_embeddings=False, **special)
    if kind == "phimoe":  # the prompts fit in original_max_position_embeddings, their continuations cross it
        return PhimoeConfig(**{**_COMMON, "intermediate_size": 32}, **special, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, lm_head_bias=True,
                            sliding_window=SLIDING_WINDOW[kind], num_local_experts=8, num_experts_per_tok=2,
                            router_jitter_noise=0.2,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                                             "original_max_position_embeddings": PHI3_ORIGINAL_MAX_POSITION,
                                             "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5, 3.0],
                                             "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
                                             "short_mscale": 1.1, "long_mscale": 1.3})
    if kind == "qwen2-moe":
        return Qwen2MoeConfig(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if kind in ("granitemoe", "granitemoe-shared"):  # Granite's multipliers (as "granite") around routed experts
        shared = dict(shared_intermediate_size=48) if kind == "granitemoe-shared" else {}
        return (GraniteMoeSharedConfig if shared else GraniteMoeConfig)(
            **{**_COMMON, "intermediate_size": 32},  # each expert's
            **special,
            **shared,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            embedding_multiplier=3.0,
            attention_multiplier=0.4,
            residual_multiplier=0.6,
            logits_scaling=2.0,
        )
    if kind == "exaone-moe":
        return ExaoneMoeConfig(**{**_COMMON, "intermediate_size": 64}, **special, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                               sliding_window=SLIDING_WINDOW[kind], sliding_window_pattern=2, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
                               first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5,
                               rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "flexolmo":
        return FlexOlmoConfig(**{**_COMMON, "intermediate_size": 32}, **special, num_attention_heads=4,
                              num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "minimax-m2":  # half of each head rotated, as the Hub's rotary_dim
        from transformers import MiniMaxM2Config

        return MiniMaxM2Config(**{**_COMMON, "intermediate_size": 32}, **special, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, num_local_experts=8,
                               num_experts_per_tok=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                "partial_rotary_factor": 0.5})
    if kind == "olmoe":
        return OlmoeConfig(
            **{**_COMMON, "intermediate_size": 32},  # each expert's
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            attention_bias=True,
            clip_qkv=3.0,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    v3_moe = dict(  # DeepSeek-V3's MLPs (GLM-4.5, dots.llm1): layer 0 dense, renormalized and scaled routing
        **_COMMON, **special, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        attention_bias=True, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, routed_scaling_factor=2.5)
    if kind == "glm4-moe":
        return Glm4MoeConfig(**v3_moe, use_qk_norm=True, n_shared_experts=1, n_group=4, topk_group=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                              "partial_rotary_factor": 0.5})
    if kind == "solar-open":  # GLM-4.5's layout without its q/k norms and dense layers (its config has neither)
        from transformers import SolarOpenConfig

        return SolarOpenConfig(**{k: v for k, v in v3_moe.items() if k not in ("intermediate_size",
                                                                                 "first_k_dense_replace")},
                               n_shared_experts=1, n_group=4, topk_group=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "dots1":  # layers from max_window_layers on windowed: layer 2
        return Dots1Config(**v3_moe, n_shared_experts=2, sliding_window=SLIDING_WINDOW[kind], max_window_layers=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "ernie4.5-moe":
        return Ernie4_5_MoeConfig(
            **_COMMON,
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            moe_layer_start_index=1,
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=2,
        )
    if kind == "hunyuan-moe":
        return HunYuanMoEV1Config(
            **{**_COMMON, "intermediate_size": 32},  # each expert's and the shared MLP's
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            attention_bias=True,
            # alpha stretches the base (10^4 -> ~10^7): rotations as the default rope's would fail the test.
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10_000.0, "alpha": 1000.0, "factor": 1.0},
            num_experts=8,
            moe_topk=[2, 1, 3],
        )
    if kind == "llama4":
        from transformers import Llama4TextConfig

        return Llama4TextConfig(
            **{**_COMMON, "intermediate_size": 48, "num_hidden_layers": 4},  # each expert's and the shared one's
            **special,
            intermediate_size_mlp=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            no_rope_layers=[1, 1, 1, 0],
            use_qk_norm=True,
            attn_temperature_tuning=True,
            floor_scale=4,
            attn_scale=0.1,
            attention_chunk_size=LLAMA4_CHUNK,
            num_local_experts=8,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
        )
    if kind in DEEPSEEK_KINDS + MLA_KINDS:
        return deepseek_config(kind, special)
    if kind == "gpt-oss":
        # swiglu_alpha / swiglu_limit at their defaults: transformers 5.17 hard-codes them.
        from transformers import GptOssConfig

        return GptOssConfig(
            **{**_COMMON, "intermediate_size": 32},  # each expert's
            **special,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            attention_bias=True,
            sliding_window=SLIDING_WINDOW[kind],
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
        )
    layernorm = dict(  # the LayerNorm families: their own epsilon and activations, partial rotary but StarCoder2
        **{k: v for k, v in _COMMON.items() if k not in ("rms_norm_eps", "hidden_act")},
        **special,
        num_attention_heads=4,
        layer_norm_eps=LAYER_NORM_EPS,
        tie_word_embeddings=False,
    )
    if kind == "starcoder2":  # tied; the epsilon named norm_epsilon
        layernorm.update(norm_epsilon=layernorm.pop("layer_norm_eps"), tie_word_embeddings=True)
        return Starcoder2Config(**layernorm, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh", use_bias=True,
                                sliding_window=SLIDING_WINDOW[kind],
                                rope_parameters={"rope_type": "default", "rope_theta": 100_000.0})
    if kind == "stablelm":
        return StableLmConfig(**layernorm, num_key_value_heads=2, hidden_act="silu", use_qkv_bias=True,
                              qk_layernorm=True, use_parallel_residual=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                               "partial_rotary_factor": 0.25})
    if kind == "persimmon":
        return PersimmonConfig(**layernorm, hidden_act="relu2", qk_layernorm=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 25_000.0,
                                                "partial_rotary_factor": 0.5})
    if kind == "phi":
        return PhiConfig(**layernorm, hidden_act="gelu_new", qk_layernorm=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5})
    if kind == "gpt-neox":  # rotary_pct: the Hub configs' name, which transformers moves into rope_parameters
        return GPTNeoXConfig(**layernorm, hidden_act="gelu", use_parallel_residual=True, attention_bias=True,
                             rotary_pct=0.25, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "gpt2":  # GPT2Config's own names: n_embd, n_layer, n_head, n_positions, n_inner
        return GPT2Config(vocab_size=MODEL_VOCAB_SIZE, n_embd=64, n_layer=3, n_head=4, n_positions=512, n_inner=128,
                          activation_function="gelu_new", layer_norm_epsilon=LAYER_NORM_EPS,
                          initializer_range=INIT_STD, tie_word_embeddings=True, **special)
    if kind == "cohere2":  # q/k/v/o biases; the Hub's sliding_window_pattern (every 2nd layer global)
        del layernorm["tie_word_embeddings"]
        return Cohere2Config(**layernorm, num_key_value_heads=2, hidden_act="silu", attention_bias=True,
                             logit_scale=0.5, tie_word_embeddings=True, sliding_window=SLIDING_WINDOW[kind],
                             sliding_window_pattern=2, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind in ("cohere2-moe", "cohere2-moe-sigmoid"):  # Cohere 2's (q/k/v/o biases, a sliding and a full layer)
        del layernorm["tie_word_embeddings"]
        layernorm["intermediate_size"] = 32  # each expert's
        # Layer 0 dense, wider, full and roped (prefix_dense_sliding_window_pattern 1); then a sliding, a full layer.
        prefix = dict(first_k_dense_replace=1, prefix_dense_intermediate_size=96, sliding_window_pattern=2)
        sigmoid = dict(rms_norm_eps=1e-5, expert_selection_fn="sigmoid", shared_expert_combination_strategy="sum")
        return Cohere2MoeConfig(**layernorm, **prefix, **(sigmoid if kind == "cohere2-moe-sigmoid" else {}),
                                num_key_value_heads=2, hidden_act="silu", attention_bias=True, logit_scale=0.5,
                                tie_word_embeddings=True, sliding_window=SLIDING_WINDOW[kind], num_experts=8,
                                num_experts_per_tok=2, num_shared_experts=1, rope_theta=10_000.0)
    if kind == "cohere":  # no biases at all; logit_scale away from 1
        del layernorm["tie_word_embeddings"]
        return CohereConfig(**layernorm, num_key_value_heads=2, hidden_act="silu", use_qk_norm=True, logit_scale=0.5,
                            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind in ("falcon", "falcon-mqa"):  # FalconConfig's names: num_kv_heads, bias, activation, ffn_hidden_size
        new = kind == "falcon"
        return FalconConfig(vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                            num_kv_heads=2 if new else None, new_decoder_architecture=new, multi_query=not new,
                            parallel_attn=True, bias=new, ffn_hidden_size=128, activation="gelu",
                            layer_norm_epsilon=LAYER_NORM_EPS, max_position_embeddings=512,
                            initializer_range=INIT_STD, tie_word_embeddings=new, **special,
                            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "gptj":  # GPTJConfig's own names, as GPT-2's; rotary_dim 8 of head_dim 16
        return GPTJConfig(vocab_size=MODEL_VOCAB_SIZE, n_embd=64, n_layer=3, n_head=4, n_positions=512, n_inner=128,
                          rotary_dim=8, activation_function="gelu_new", layer_norm_epsilon=LAYER_NORM_EPS,
                          initializer_range=INIT_STD, tie_word_embeddings=False, **special)
    if kind == "bloom":  # BloomConfig's names: n_layer, n_head; the MLP 4x hidden_size
        return BloomConfig(vocab_size=MODEL_VOCAB_SIZE, hidden_size=96, n_layer=3, n_head=6,
                           layer_norm_epsilon=LAYER_NORM_EPS, initializer_range=INIT_STD, tie_word_embeddings=True,
                           **special)
    if kind == "mpt":  # MptConfig's names: d_model, n_heads, n_layers, expansion_ratio, max_seq_len, attn_config
        return MptConfig(vocab_size=MODEL_VOCAB_SIZE, d_model=64, n_heads=4, n_layers=3, expansion_ratio=4,
                         max_seq_len=512, layer_norm_epsilon=LAYER_NORM_EPS, initializer_range=INIT_STD,
                         attn_config={"clip_qkv": 2.0, "softmax_scale": 0.15, "alibi_bias_max": 8},
                         tie_word_embeddings=True, **special)
    if kind == "gpt-bigcode":
        return GPTBigCodeConfig(vocab_size=MODEL_VOCAB_SIZE, n_embd=64, n_layer=3, n_head=4, n_positions=512,
                                n_inner=128, multi_query=True, activation_function="gelu",
                                layer_norm_epsilon=LAYER_NORM_EPS, initializer_range=INIT_STD,
                                tie_word_embeddings=True, **special)
    if kind in ("opt", "opt-350m"):  # OPTConfig's names: ffn_dim, activation_function, enable_bias; no epsilon
        pre_norm = kind == "opt"
        return OPTConfig(vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                         ffn_dim=128, max_position_embeddings=512, do_layer_norm_before=pre_norm,
                         word_embed_proj_dim=64 if pre_norm else 32, enable_bias=pre_norm,
                         activation_function="relu", init_std=INIT_STD, **special)
    if kind == "biogpt":
        return BioGptConfig(vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=512, hidden_act="gelu",
                            layer_norm_eps=LAYER_NORM_EPS, initializer_range=INIT_STD, **special)
    if kind == "xglm":  # XGLMConfig's names: d_model, num_layers, attention_heads, ffn_dim, activation_function
        return XGLMConfig(vocab_size=MODEL_VOCAB_SIZE, d_model=64, num_layers=3, attention_heads=4, ffn_dim=128,
                          max_position_embeddings=512, activation_function="gelu", init_std=INIT_STD, **special)
    if kind == "gpt-neox-japanese":  # rotary_pct, rotary_emb_base: the config's (Hub) names for the rope
        return GPTNeoXJapaneseConfig(vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, intermediate_multiple_size=3, hidden_act="gelu",
                                     rotary_pct=1.0, rotary_emb_base=10_000, max_position_embeddings=512,
                                     layer_norm_eps=LAYER_NORM_EPS, initializer_range=INIT_STD, **special)
    if kind == "gpt-neo":  # GPTNeoConfig's names: num_layers, num_heads; attention_types [[types, repeats], ...]
        return GPTNeoConfig(vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_layers=3, num_heads=4,
                            intermediate_size=128, max_position_embeddings=512, window_size=SLIDING_WINDOW[kind],
                            attention_types=[[["local", "global"], 1], [["local"], 1]], activation_function="gelu_new",
                            layer_norm_epsilon=LAYER_NORM_EPS, initializer_range=INIT_STD, **special)
    if kind == "codegen":  # CodeGenConfig's names, as GPT-J's
        return CodeGenConfig(vocab_size=MODEL_VOCAB_SIZE, n_embd=64, n_layer=3, n_head=8, n_positions=512,
                             n_ctx=512, n_inner=128, rotary_dim=4, activation_function="gelu_new",
                             layer_norm_epsilon=LAYER_NORM_EPS, initializer_range=INIT_STD, **special)
    if kind == XLSTM_KIND:  # xLSTMConfig's names: num_heads, norm_eps, the MLP's width by ffn_proj_factor
        # hidden_size 128: transformers' cache sizes the query heads by qk_dim rounded up to a multiple of 64
        return xLSTMConfig(vocab_size=MODEL_VOCAB_SIZE, hidden_size=128, num_hidden_layers=3, num_heads=4,
                           qk_dim_factor=0.5, v_dim_factor=1.0, ffn_proj_factor=2.0, ffn_round_up_to_multiple_of=48,
                           chunk_size=128, gate_soft_cap=3.0, output_logit_soft_cap=4.0, norm_eps=1e-5,
                           initializer_range=INIT_STD, **special)
    if kind == "ctrl":  # CTRLConfig's names: n_embd, n_layer, n_head, n_positions, dff
        return CTRLConfig(vocab_size=MODEL_VOCAB_SIZE, n_embd=64, n_layer=3, n_head=4, n_positions=512, dff=128,
                          layer_norm_epsilon=LAYER_NORM_EPS, initializer_range=INIT_STD, tie_word_embeddings=True,
                          **special)
    if kind in SEQ2SEQ_DECODER_KINDS:
        return seq2seq_decoder_config(kind, special)
    if kind == "openai-gpt":  # OpenAIGPTConfig's names, as GPT-2's; the MLP 4x n_embd, its activation `afn`
        return OpenAIGPTConfig(vocab_size=MODEL_VOCAB_SIZE, n_embd=64, n_layer=3, n_head=4, n_positions=512,
                               afn="gelu", layer_norm_epsilon=LAYER_NORM_EPS, initializer_range=INIT_STD,
                               tie_word_embeddings=True, **special)
    raise ValueError(f"unknown model kind {kind!r}; expected one of {ALL_KINDS + (ODD_KIND, OLMO2_MQA_KIND)}")


def seq2seq_decoder_config(kind: str, special: dict):
    """SEQ2SEQ_DECODER_KINDS' configs: the decoder's sizes (decoder_*) apart from the encoder's, which transformers'
    *ForCausalLM leaves unused but for the layers of generate()'s cache (num_hidden_layers, the encoder's: no fewer
    than the decoder's)."""
    import transformers

    config_class = getattr(transformers, SEQ2SEQ_DECODER_KINDS[kind] + "Config")
    sizes = dict(vocab_size=MODEL_VOCAB_SIZE, d_model=64, decoder_layers=3, decoder_attention_heads=4,
                 decoder_ffn_dim=128, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=32,
                 activation_function="relu" if kind in ("pegasus", "blenderbot") else "gelu",
                 init_std=INIT_STD, **special)
    if kind == "trocr":  # a decoder's config alone; no embeddings' LayerNorm (`layernorm_embedding`)
        return config_class(**{k: v for k, v in sizes.items() if not k.startswith("encoder_")},
                            max_position_embeddings=512, scale_embedding=True, layernorm_embedding=False)
    if kind == "bigbird-pegasus":  # no attention biases (use_bias); full attention (the encoder's block-sparse unused)
        return config_class(**sizes, max_position_embeddings=512, scale_embedding=True, use_bias=False,
                            attention_type="original_full")
    if kind == "whisper":  # its decoder's positions: max_target_positions; scale_embedding, which it ignores
        return config_class(**sizes, max_target_positions=512, max_source_positions=64, decoder_start_token_id=1,
                            scale_embedding=True)
    return config_class(**sizes, max_position_embeddings=512, scale_embedding=kind != "mvp",
                        tie_word_embeddings=kind != "mbart")


def bert_decoder_config(kind: str, special: dict):
    """BERT_DECODER_KINDS' configs: transformers' class by name, the kind's own settings."""
    import transformers

    name, settings = {"bert-lmhead": ("BertConfig", dict(hidden_act="gelu_new")),
                      "ernie-lmhead": ("ErnieConfig", dict(use_task_id=True, task_type_vocab_size=3)),
                      "bert-generation-lmhead": ("BertGenerationConfig", {}),
                      "electra-lmhead": ("ElectraConfig", dict(embedding_size=32, hidden_act="relu")),
                      "roberta-lmhead": ("RobertaConfig", dict(hidden_act="relu")),
                      "xlm-roberta-lmhead": ("XLMRobertaConfig", {}),
                      "camembert-lmhead": ("CamembertConfig", {}),
                      "data2vec-text-lmhead": ("Data2VecTextConfig", {}),
                      "roberta-prelayernorm-lmhead": ("RobertaPreLayerNormConfig", {}),
                      "xlm-roberta-xl-lmhead": ("XLMRobertaXLConfig", {}),
                      "megatron-bert-lmhead": ("MegatronBertConfig", {}),
                      "big-bird-lmhead": ("BigBirdConfig", dict(use_bias=False, rescale_embeddings=True)),
                      "rembert-lmhead": ("RemBertConfig", dict(input_embedding_size=32, output_embedding_size=48,
                                                               tie_word_embeddings=False)),
                      "xmod-lmhead": ("XmodConfig", dict(languages=["en_XX", "de_DE"], default_language="de_DE",
                                                         adapter_reduction_factor=2)),
                      "roc-bert-lmhead": ("RoCBertConfig", dict(shape_vocab_size=20, shape_embed_dim=16,
                                                                pronunciation_vocab_size=30,
                                                                pronunciation_embed_dim=24)),
                      "roformer-lmhead": ("RoFormerConfig", dict(embedding_size=32))}[kind]
    settings = dict(hidden_act="gelu", tie_word_embeddings=True) | settings
    return getattr(transformers, name)(vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_hidden_layers=3,
                                       num_attention_heads=4, intermediate_size=128, max_position_embeddings=512,
                                       layer_norm_eps=LAYER_NORM_EPS, initializer_range=INIT_STD, is_decoder=True,
                                       **settings, **special)


def newest_family_config(kind: str, special: dict):
    """NEWEST_KINDS' configs, imported by name: transformers 5.17 lacks some of these families."""
    import transformers

    common = dict(**_COMMON, **special, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=False)
    if kind == "afmoe":
        return transformers.AfmoeConfig(**{**common, "intermediate_size": 96}, attention_bias=True,
                                        sliding_window=SLIDING_WINDOW[kind], global_attn_every_n_layers=2,
                                        mup_enabled=True, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
                                        num_shared_experts=1, moe_intermediate_size=32, route_scale=2.5,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "mellum":
        return transformers.MellumConfig(**{**common, "intermediate_size": 96}, attention_bias=True,
                                         sliding_window=SLIDING_WINDOW[kind],
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                         mlp_layer_types=["dense", "sparse", "sparse"], num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                         rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 10_000.0},
                                                          "full_attention": {"rope_type": "default",
                                                                             "rope_theta": 500_000.0}})
    if kind == "hy-v3":
        return transformers.HYV3Config(**{**common, "intermediate_size": 96}, attention_bias=True, mlp_bias=True,
                                       mlp_layer_types=["dense", "sparse", "sparse"], num_experts=8,
                                       num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32,
                                       router_scaling_factor=2.5,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "laguna":
        return transformers.LagunaConfig(**{**common, "intermediate_size": 96}, attention_bias=True, gating=True,
                                         num_attention_heads_per_layer=[4, 6, 2], sliding_window=SLIDING_WINDOW[kind],
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                         mlp_layer_types=["dense", "sparse", "sparse"], num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, moe_routed_scaling_factor=2.5,
                                         moe_router_logit_softcapping=1.5,
                                         rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 10_000.0},
                                                          "full_attention": {"rope_type": "default",
                                                                             "rope_theta": 500_000.0,
                                                                             "partial_rotary_factor": 0.5}})
    if kind == "flint":
        return transformers.FlintConfig(**{**common, "intermediate_size": 96}, attention_bias=True,
                                        sliding_window=SLIDING_WINDOW[kind],
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        mlp_only_layers=[0], num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                        norm_topk_prob=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "kolibri1":  # no dense MLP: no intermediate_size
        return transformers.Kolibri1Config(**{k: v for k, v in common.items() if k != "intermediate_size"},
                                           sliding_window=SLIDING_WINDOW[kind],
                                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32, norm_topk_prob=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "kolibri1-1":  # its dense MLP's width is mlp_only_intermediate_size
        return transformers.Kolibri1_1Config(
            **{k: v for k, v in common.items() if k != "intermediate_size"} | {"num_hidden_layers": 4},
            sliding_window=SLIDING_WINDOW[kind],
            layer_types=["indexed_attention", "sliding_attention", "indexed_attention", "indexed_attention"],
            index_layers=[0, 3], kv_source_layers=[0, 1, 0, 0], index_topk=KOLIBRI11_TOPK,
            index_pool_size=KOLIBRI11_POOL, index_compression=KOLIBRI11_BLOCK, index_num_heads=2,
            index_num_local_tokens=4, index_num_sink_tokens=2, mlp_only_layers=[0], mlp_only_intermediate_size=96,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "lfm3":
        lfm3 = {**common, "intermediate_size": 96, "num_hidden_layers": 4}
        return transformers.Lfm3Config(**{k: v for k, v in lfm3.items() if k != "rms_norm_eps"}, norm_eps=1e-5,
                                       conv_L_cache=3, conv_bias=True, layer_types=["conv", "sliding_attention", "conv",
                                                                         "full_attention"],
                                       sliding_window=LFM3_SLIDING_WINDOW, use_sandwich_norm=True,
                                       use_attention_gate=True, attention_bias=True,
                                       rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10_000.0},
                                                        "full_attention": {"rope_type": "proportional",
                                                                           "rope_theta": 1_000_000.0,
                                                                           "partial_rotary_factor": 0.5}})
    if kind in ("deepseek-v32", "deepseek-v32-wide", "glm-moe-dsa", "axk2", "dots3-note", "hy-v4"):
        return dsa_config(kind, special)
    if kind == "apertus1.5":  # Apertus's; its head pruned to the first 448 ids (the engine's logits past it -inf)
        return transformers.Apertus1p5TextConfig(**{**common, "intermediate_size": 96, "hidden_act": "xielu"},
                                                 attention_bias=True, output_vocab_size=448,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "dory":  # released configs list each layer as an attention and an mlp block: saved so, read back
        return transformers.DoryConfig(**{k: v for k, v in common.items() if k not in ("rms_norm_eps",
                                                                                      "num_hidden_layers")},
                                       num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
                                       n_recurrent_loops=DORY_LOOPS, sliding_window=SLIDING_WINDOW[kind],
                                       layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                    "full_attention"],
                                       attention_bias=True, mlp_bias=True, ngpt_alpha_init=DORY_ALPHA_INIT,
                                       rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10_000.0},
                                                        "full_attention": {"rope_type": "default",
                                                                           "rope_theta": 500_000.0}})
    if kind == "minicpm5-moe":  # layer 0 dense; 2 of 8 experts in 2 of 4 groups, scaled, plus a shared expert
        return transformers.MiniCPM5MoeConfig(**{**common, "intermediate_size": 96}, attention_bias=True,
                                              mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=8,
                                              num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                              moe_intermediate_size=32, routed_scaling_factor=2.5,
                                              norm_topk_prob=True,
                                              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "ergo":  # no head_dim (hidden / heads), no hidden_act (relu^2), no dense intermediate_size
        return transformers.ErgoConfig(
            **{k: v for k, v in common.items() if k not in ("head_dim", "hidden_act", "intermediate_size")},
            sliding_window=SLIDING_WINDOW[kind], global_attention_every_n_layers=2, global_attention_scale=1.7,
            num_dense_blocks=1, first_dense_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_intermediate_size=32, moe_routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "phi4-multimodal":  # no head_dim (hidden / heads); the towers as small as they build
        return transformers.Phi4MultimodalConfig(
            **{k: v for k, v in common.items() if k != "head_dim"} | {"tie_word_embeddings": True},
            sliding_window=SLIDING_WINDOW[kind], original_max_position_embeddings=PHI3_ORIGINAL_MAX_POSITION,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0, 1.2, 1.4, 1.7, 2.1, 2.6],
                             "long_factor": [1.0, 3.0, 5.0, 9.0, 17.0, 33.0]},
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 56, "crop_size": 56, "patch_size": 14},
            audio_config={"hidden_size": 32, "intermediate_size": 64, "num_blocks": 1, "num_attention_heads": 2,
                          "ext_pw_out_channel": 32, "depthwise_separable_out_channel": 32, "nemo_conv_channels": 32})
    if kind == "mistral4":  # MLA as DeepSeek's test kinds: a key and a value per query head; head_dim its own
        return transformers.Mistral4Config(
            **{k: v for k, v in common.items() if k not in ("num_key_value_heads", "head_dim")}, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            attention_bias=True, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
            topk_group=2, n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 0.707, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5})
    if kind == "deepseek-v4":  # one KV head, its own head_dim; no dense MLP
        return transformers.DeepseekV4Config(
            **{k: v for k, v in common.items() if k not in ("intermediate_size", "num_key_value_heads", "head_dim")},
            head_dim=32, partial_rotary_factor=0.25, q_lora_rank=24, o_groups=2, o_lora_rank=16,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=DSV4_WINDOW,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            index_n_heads=8, index_head_dim=16, index_topk=DSV4_INDEX_TOPK, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, swiglu_limit=DSV4_SWIGLU_LIMIT, hc_mult=3, hc_sinkhorn_iters=2, hc_eps=1e-3,
            compress_rope_theta=1_000.0, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32,
                                                          "beta_slow": 1, "original_max_position_embeddings": 128})
    if kind == "inkling":
        return transformers.InklingTextConfig(**{**common, "intermediate_size": 96},
                                              architectures=["InklingForCausalLM"], swa_num_attention_heads=6,
                                              swa_num_key_value_heads=2, swa_head_dim=8,
                                              sliding_window_size=INKLING_SLIDING_WINDOW, d_rel=4,
                                              rel_extent=INKLING_REL_EXTENT, log_scaling_n_floor=8,
                                              log_scaling_alpha=0.5,
                                              layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                                              mlp_layer_types=["dense", "sparse", "sparse"], conv_kernel_size=4,
                                              moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                              n_shared_experts=2, route_scale=2.5, logits_mup_width_multiplier=2.0)
    if kind == "minimax-m3":
        return transformers.MiniMaxM3VLTextConfig(
            **common, dense_intermediate_size=96, shared_intermediate_size=32, num_local_experts=8,
            num_experts_per_tok=2, index_n_heads=2, index_head_dim=16, index_block_size=MINIMAX_M3_BLOCK,
            index_topk_blocks=3, index_local_blocks=2, layer_types=["full_attention", "minimax_m3_sparse",
                                                                    "minimax_m3_sparse"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5})
    if kind == "qwen4-exp":
        return transformers.Qwen4ExpTextConfig(
            **{k: v for k, v in common.items() if k not in ("intermediate_size", "head_dim")}, head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
            layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            hc_count=3, hc_lowrank=16, ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2,
            ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2, indexer_n_heads=2,
            indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
            output_gate_type="sigmoid")
    if kind in ("inkling2", "inkling2-loop"):
        if kind == "inkling2":
            config_class = transformers.Inkling2TextConfig
            layers = dict(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], n_layers_per_attn_res_block=2,
                          route_scale=2.5)
        else:
            config_class = transformers.Inkling2LoopTextConfig
            layers = dict(num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid"] * 2,
                          n_layers_per_attn_res_block=1, route_scale=INKLING2_LOOP_ROUTE_SCALE,
                          loop_layer_index_start=1, loop_layer_index_end=3, loop_num_passes=INKLING2_LOOP_PASSES,
                          loop_gate_rank=8)
        # unpadded_vocab_size: the LM head's rows (transformers 5.25's head, the checkpoint's padded to vocab_size;
        # 5.23's head holds vocab_size rows and drops the logits past it), all of them (the default, 200058, is the
        # Hub's: 5.25 cannot save a head that size padded to the test vocabulary).
        return config_class(**{**common, "intermediate_size": 32, **layers},  # its experts'
                            unpadded_vocab_size=common["vocab_size"],
                            architectures=[config_class.__name__.replace("TextConfig", "ForCausalLM")],
                            swa_num_attention_heads=6, swa_num_key_value_heads=2, swa_head_dim=8,
                            sliding_window_size=INKLING_SLIDING_WINDOW, d_rel=4, rel_extent=INKLING_REL_EXTENT,
                            log_scaling_n_floor=8, log_scaling_alpha=0.5, **INKLING2_CLIPS, conv_kernel_size=4,
                            n_routed_experts=8, num_experts_per_tok=2, mlp_gate_softcap=0.5, mlp_up_softcap=1.0,
                            final_logit_softcapping=3.0)
    if kind == "lara-mini":  # every MLP sparse: no intermediate_size
        return transformers.LaraMiniConfig(**{k: v for k, v in common.items() if k != "intermediate_size"},
                                           attention_bias=True, sliding_window=LARA_MINI_SLIDING_WINDOW,
                                           layer_types=["linear_attention", "sliding_attention", "full_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                           linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, norm_topk_prob=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "olmo-hybrid":
        # No head_dim: hidden / heads. Values as wide as keys: transformers' save_pretrained splits the fused conv
        # back into the Hub's q/k/v convs in three equal parts.
        return transformers.OlmoHybridConfig(**{k: v for k, v in common.items() if k != "head_dim"},
                                             attention_bias=True,
                                             layer_types=["linear_attention", "full_attention", "linear_attention"],
                                             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                             linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                             linear_allow_neg_eigval=True,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "kimi-linear":  # MLA as DeepSeek's test kinds; no head_dim (transformers derives it)
        return transformers.KimiLinearConfig(**{k: v for k, v in common.items()
                                                if k not in ("head_dim", "num_key_value_heads")},
                                             num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                             layer_types=["linear_attention", "full_attention", "linear_attention"],
                                             mlp_layer_types=["dense", "sparse", "sparse"], linear_num_heads=4,
                                             linear_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
                                             num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                             moe_intermediate_size=32, routed_scaling_factor=2.5)
    if kind == "bailing-hybrid":  # head_dim: the KDA heads' (transformers' config sets it to qk_rope_head_dim after)
        return transformers.BailingHybridConfig(**{**common, "num_key_value_heads": 4}, kv_lora_rank=32,
                                                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                                layer_types=["linear_attention", "full_attention", "linear_attention"],
                                                mlp_layer_types=["dense", "sparse", "sparse"], short_conv_kernel_size=4,
                                                num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                                n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5,
                                                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "zaya":
        zaya = {k: v for k, v in common.items() if k != "intermediate_size"} | {"tie_word_embeddings": True}
        return transformers.ZayaConfig(**zaya, attention_bias=True, lm_head_bias=True,
                                       layer_types=["hybrid", "hybrid_sliding", "hybrid"],
                                       sliding_window=ZAYA_SLIDING_WINDOW, num_experts=4, num_experts_per_tok=1,
                                       moe_intermediate_size=32, router_hidden_size=16, cca_time0=2, cca_time1=3,
                                       rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 500_000.0,
                                                                   "partial_rotary_factor": 0.5},
                                                        "hybrid_sliding": {"rope_type": "default",
                                                                           "rope_theta": 10_000.0,
                                                                           "partial_rotary_factor": 0.5}})
    if kind == "minimax":
        # No window: transformers' MiniMax decodes without it (its MiniMaxCache keeps every key), prefills with it.
        return transformers.MiniMaxConfig(**{**common, "intermediate_size": 32},
                                          layer_types=["linear_attention", "full_attention", "linear_attention"],
                                          num_local_experts=8, num_experts_per_tok=2, block_size=16,
                                          full_attn_alpha_factor=1.8, full_attn_beta_factor=0.7,
                                          linear_attn_alpha_factor=1.5, linear_attn_beta_factor=1.2,
                                          mlp_alpha_factor=2.2, mlp_beta_factor=0.9,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "mimo-v2-flash":
        return transformers.MiMoV2FlashConfig(**{**common, "intermediate_size": 96, "head_dim": 24,
                                                 "num_key_value_heads": 1}, v_head_dim=16, attention_value_scale=0.6,
                                              attention_bias=True, sliding_window=SLIDING_WINDOW[kind],
                                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                              mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=8,
                                              num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
                                              norm_topk_prob=True, routed_scaling_factor=2.5,
                                              rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                     "rope_theta": 10_000.0},
                                                               "full_attention": {"rope_type": "default",
                                                                                  "rope_theta": 500_000.0,
                                                                                  "partial_rotary_factor": 0.5}})
    if kind == "longcat-flash":  # num_layers decoder layers of two attention sublayers; MLA keys and values per head
        return transformers.LongcatFlashConfig(**{k: v for k, v in common.items() if k not in (
            "num_hidden_layers", "num_key_value_heads", "head_dim")}, num_layers=2, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, n_routed_experts=8, zero_expert_num=4,
            moe_topk=3, expert_ffn_hidden_size=32, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "doge":  # no head_dim: hidden / heads; keys within keep_window_size, so no top-k dynamic mask
        return transformers.DogeConfig(**{k: v for k, v in common.items() if k != "head_dim"}, attention_bias=True,
                                       mlp_bias=True, keep_window_size=512,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "hyperclovax":
        return transformers.HyperCLOVAXConfig(**common, use_post_norm=True, embedding_multiplier=3.0,
                                              attention_multiplier=0.4, residual_multiplier=0.6, logits_scaling=0.5,
                                              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "bitnet":
        return transformers.BitNetConfig(**{k: v for k, v in common.items() if k not in ("hidden_act", "head_dim")},
                                         hidden_act="relu2",
                                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "minicpm3":  # tied, as MiniCPM3-4B
        return transformers.MiniCPM3Config(**{**common, "num_key_value_heads": 4, "tie_word_embeddings": True},
                                           kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                           v_head_dim=16, scale_emb=3.0, scale_depth=1.4, dim_model_base=32,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "diffllama":
        # rms_norm_eps DiffLlama's default, 1e-5: its differential outputs' norm takes it (1e-6 there fails the test).
        return transformers.DiffLlamaConfig(**{**common, "num_attention_heads": 8, "num_key_value_heads": 4,
                                               "rms_norm_eps": 1e-5},
                                            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "hrm-text":  # 2 layers per stack, 2 high-level cycles of 2 low-level runs each: 12 runs of a layer
        return transformers.HrmTextConfig(**{k: v for k, v in common.items() if k not in ("num_key_value_heads",
                                                                                          "num_hidden_layers")},
                                          num_hidden_layers=2, H_cycles=2, L_cycles=2, embedding_scale=3.0,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "jetmoe":
        return transformers.JetMoeConfig(**{k: v for k, v in common.items() if k not in (
            "num_attention_heads", "head_dim", "hidden_act", "intermediate_size", "rms_norm_eps")},
                                         kv_channels=16, intermediate_size=32, num_local_experts=8,
                                         num_experts_per_tok=2, rms_norm_eps=1e-5,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "aria-text":
        return transformers.AriaTextConfig(**{**common, "intermediate_size": 32}, attention_bias=True, mlp_bias=True,
                                           moe_num_experts=8, moe_topk=2, moe_num_shared_experts=2,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "beam":  # depth-scaled adds rescale the whole residual stream, which only the norms' epsilon sees
        return transformers.BeamConfig(**{**common, "intermediate_size": 96, "rms_norm_eps": BEAM_RMS_NORM_EPS},
                                       attention_bias=True,
                                       sliding_window=SLIDING_WINDOW[kind],
                                       layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                       mlp_layer_types=["dense", "sparse", "sparse"], num_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
                                       norm_topk_prob=True, routed_scaling_factor=2.5, final_logit_softcapping=5.0,
                                       rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10_000.0},
                                                        "full_attention": None})
    if kind == "cohere-compass":  # no head_dim (hidden / heads), LayerNorms without bias
        return transformers.CohereCompassTextConfig(
            **{k: v for k, v in common.items() if k not in ("head_dim", "rms_norm_eps")}, layer_norm_eps=LAYER_NORM_EPS,
            attention_bias=True, logit_scale=0.5, sliding_window=SLIDING_WINDOW[kind],
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": None})
    if kind == "modernbert-decoder":  # its own names for the sizes, no KV heads, no head_dim
        return transformers.ModernBertDecoderConfig(
            **{k: v for k, v in common.items() if k not in ("head_dim", "rms_norm_eps", "hidden_act",
                                                            "num_key_value_heads", "tie_word_embeddings")},
            hidden_activation="gelu", classifier_activation="gelu", norm_eps=LAYER_NORM_EPS, norm_bias=True,
            attention_bias=True, mlp_bias=True, classifier_bias=True, decoder_bias=True, tie_word_embeddings=True,
            local_attention=2 * SLIDING_WINDOW[kind], layer_types=["full_attention", "sliding_attention",
                                                                  "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    raise ValueError(f"unknown model kind {kind!r}; expected one of {NEWEST_KINDS}")


def qwen3_next_config(kind: str, special: dict):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    hybrid = dict(
        **_COMMON,
        **special,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
        # Linear attention first, then alternating: a linear layer also follows a full one.
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # two value heads per key head
        linear_key_head_dim=16,
        linear_value_head_dim=24,  # != the key head dim, so a transposed state would fail
        linear_conv_kernel_dim=4,
    )
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if kind == "qwen3.5":
        return Qwen3_5TextConfig(**hybrid)
    if kind == "qwen3.5-moe":  # every layer's MLP: 2 of 8 experts (renormalized) plus the gated shared expert
        return Qwen3_5MoeTextConfig(**{k: v for k, v in hybrid.items() if k != "intermediate_size"}, **experts)
    # Layers 1 and 2 route each token to 2 of 8 experts plus the gated shared expert; layer 0 is dense.
    return Qwen3NextConfig(**hybrid, **experts, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])


def ssm_config(kind: str, special: dict):
    from transformers import BambaConfig, GraniteMoeHybridConfig, Lfm2Config, Lfm2MoeConfig

    common = dict(**special, vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=INIT_STD)
    if kind == "lfm2":
        # The MLP's width: 2/3 of 128, rounded up to a multiple of 32 (96); the conv with biases (LFM2's have none).
        return Lfm2Config(**common, intermediate_size=128, block_multiple_of=32, norm_eps=1e-5, conv_L_cache=3,
                          conv_bias=True, layer_types=["conv", "full_attention", "conv"], tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    if kind == "recurrent-gemma":
        from transformers import RecurrentGemmaConfig
        # hidden_size 48: sqrt(48) is not a bf16 number (the embedding's normalizer rounds).
        kept = {k: v for k, v in common.items() if k not in ("max_position_embeddings", "num_key_value_heads")}
        return RecurrentGemmaConfig(**kept | {"hidden_size": 48}, intermediate_size=192, lru_width=48,
                                    num_key_value_heads=1, attention_bias=True,
                                    attention_window_size=RECURRENT_GEMMA_WINDOW, logits_soft_cap=4.0,
                                    rms_norm_eps=1e-6, tie_word_embeddings=True)
    if kind == "rwkv":
        from transformers import RwkvConfig
        return RwkvConfig(**special, vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_hidden_layers=4,
                          intermediate_size=128, rescale_every=2, layer_norm_epsilon=RWKV_LAYER_NORM_EPS,
                          tie_word_embeddings=False)
    if kind == "lfm2-moe":
        return Lfm2MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=2.5, norm_eps=1e-5,
                             conv_L_cache=3, conv_bias=True, layer_types=["conv", "full_attention", "conv"],
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    # 16-token scan chunks (prompts span several; real models: 256), 8 heads of 16 in 2 groups (Bamba: 1).
    mamba = dict(mamba_n_heads=8, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
                 mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-5, hidden_act="silu",
                 tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "bamba":  # rope over half of each head (transformers sets partial_rotary_factor 0.5)
        return BambaConfig(**common, **mamba, intermediate_size=128, mamba_n_groups=1, attn_layer_indices=[1])
    # Granite's multipliers, each away from 1 (as "granite"); Mamba2 layers around an attention layer; 1 group, as
    # Granite 4.0-H's (transformers 5.17 normalizes its gated norm over all groups at once; NemotronH's kinds have 2).
    granite = dict(embedding_multiplier=3.0, attention_multiplier=0.4, residual_multiplier=0.6, logits_scaling=2.0,
                   mamba_n_groups=1, layer_types=["linear_attention", "full_attention", "linear_attention"])
    if kind == "granitemoehybrid":  # 2 of 8 experts beside the shared MLP, rope
        return GraniteMoeHybridConfig(**common, **mamba, **granite, intermediate_size=32, shared_intermediate_size=48,
                                      num_local_experts=8, num_experts_per_tok=2, position_embedding_type="rope")
    # The shared MLP alone, no position encoding (Granite 4.0-H's "nope").
    return GraniteMoeHybridConfig(**common, **mamba, **granite, shared_intermediate_size=128, num_local_experts=0,
                                  position_embedding_type="nope")


def mamba2_hybrid_config(kind: str, special: dict):
    from transformers import FalconH1Config, Mamba2Config, NemotronHConfig, Zamba2Config

    # Mamba2: 8 heads of 16, 16-token scan chunks, projection biases, tied; 1 group, as the mamba2-* checkpoints have
    # (transformers 5.17's gated norm is not grouped: NemotronH's and Zamba2's kinds cover 2 groups on both versions).
    if kind == "mamba2":
        return Mamba2Config(**special, vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_hidden_layers=3, num_heads=8,
                            head_dim=16, expand=2, n_groups=1, state_size=16, conv_kernel=4, chunk_size=16,
                            use_bias=True, use_conv_bias=True, layer_norm_epsilon=1e-5, initializer_range=INIT_STD,
                            tie_word_embeddings=True)

    if kind == "zamba2":  # heads of 2 x 64 / 4 = 32 channels; 8 Mamba2 heads of 16 in 2 groups; adapters of rank 8
        return Zamba2Config(**special, vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_attention_heads=4,
                            max_position_embeddings=512, initializer_range=INIT_STD, intermediate_size=96,
                            num_hidden_layers=5,
                            layers_block_type=["hybrid", "linear_attention", "hybrid", "hybrid", "linear_attention"],
                            num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, n_mamba_heads=8,
                            mamba_ngroups=2, mamba_d_state=16, chunk_size=16, add_bias_linear=True, rms_norm_eps=1e-5,
                            tie_word_embeddings=True)
    common = dict(**special, vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=512, initializer_range=INIT_STD)
    if kind == "nemotron-h":  # every block type ("M*E-M"), 2 of 8 experts in 2 groups, Mamba2 projection biases
        return NemotronHConfig(**common, layers_block_type=["linear_attention", "full_attention", "moe", "mlp",
                                                            "linear_attention"],
                               mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
                               chunk_size=16, use_bias=True, intermediate_size=96, n_routed_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                               n_group=2, topk_group=1, routed_scaling_factor=2.5, layer_norm_epsilon=1e-5,
                               tie_word_embeddings=False,
                               # dt's floor, which binds here: transformers 5.23's is time_step_min, 5.25's (and the
                               # engine's) time_step_limit's lower end
                               time_step_min=0.001, time_step_limit=(0.001, float("inf")))
    # 6 heads of 16 Mamba2 channels (mamba_d_ssm, not expand x hidden) in 2 groups; every multiplier away from 1.
    falcon = dict(num_hidden_layers=2, intermediate_size=96, mamba_d_ssm=96, mamba_n_heads=6, mamba_n_groups=2,
                  mamba_d_state=16, mamba_chunk_size=16, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                  embedding_multiplier=2.0, lm_head_multiplier=0.5, mlp_multipliers=[0.7, 1.3], key_multiplier=0.8,
                  attention_in_multiplier=1.2, attention_out_multiplier=0.9, ssm_multipliers=[0.6, 1.1, 0.9, 1.2, 0.8],
                  ssm_in_multiplier=1.1, ssm_out_multiplier=0.7)
    if kind == "falcon-h1":  # the gate alone after the scan, biases on the Mamba2 projections, tied embeddings
        return FalconH1Config(**common, **falcon, mamba_rms_norm=False, mamba_proj_bias=True, projectors_bias=True,
                              tie_word_embeddings=True)
    # The gated norm, applied before the gate; attention biases.
    return FalconH1Config(**common, **falcon, mamba_rms_norm=True, mamba_norm_before_gate=True, attention_bias=True,
                          tie_word_embeddings=False)


def _randomize_rwkv_(model, seed: int) -> None:
    """RWKV's LayerNorm weights (ln1, ln2, pre_ln, ln_out) near 1, as the others'; per-channel decays exp(time_decay)
    from 0.0025 (the state carries far) to 7 a token, bonuses time_first of either sign, lerp weights in [0, 1]."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(("ln1.weight", "ln2.weight", "pre_ln.weight", "ln_out.weight")):
                p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=g))
            elif name.endswith("time_decay"):
                p.copy_(torch.linspace(-6.0, 2.0, p.numel()))
            elif name.endswith("time_first"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif ".time_mix_" in name:
                p.copy_(torch.rand(p.shape, generator=g))


def _randomize_mamba_(model, seed: int) -> None:
    """Mamba2 decays from slow to fast per head (A = -0.01 .. -1) and small steps (dt_bias near -2): the state carries
    far, across scan chunks and prefill chunks."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(("mamba.A_log", "mixer.A_log")):
                p.copy_(torch.linspace(0.01, 1.0, p.numel()).log())
            elif name.endswith(("mamba.dt_bias", "mixer.dt_bias")):
                p.copy_(-2.0 + 0.5 * torch.randn(p.shape, generator=g))


def mamba1_config(kind: str, special: dict):
    from transformers import FalconMambaConfig, JambaConfig, MambaConfig, ZambaConfig

    # 128 channels (expand 2), 8 states per channel, dt of rank 8.
    common = dict(**special, vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, initializer_range=INIT_STD, hidden_act="silu")
    mamba = dict(num_hidden_layers=3, state_size=8, expand=2, conv_kernel=4, time_step_rank=8, use_conv_bias=True,
                 layer_norm_epsilon=1e-5, residual_in_fp32=True)
    if kind == "mamba":
        return MambaConfig(**common, **mamba, use_bias=True, tie_word_embeddings=True)
    if kind == "falcon-mamba":
        return FalconMambaConfig(**common, **mamba, use_bias=False, mixer_rms_eps=1e-6, tie_word_embeddings=False)
    if kind == "zamba":  # layers M M H M H M: the shared block invoked twice; 2 mixer heads of 64 channels; GQA
        return ZambaConfig(**common, num_hidden_layers=6, attn_layer_period=2, attn_layer_offset=1,
                           intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, rms_norm_eps=1e-5, hidden_mamba_act="silu", n_mamba_heads=2,
                           mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, mamba_conv_bias=True,
                           mamba_proj_bias=False, tie_word_embeddings=True)
    return JambaConfig(**common, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, attn_layer_period=4,
                       attn_layer_offset=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                       expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
                       mamba_conv_bias=True, mamba_proj_bias=False, tie_word_embeddings=False)


def _randomize_mamba1_(model, seed: int) -> None:
    """Decays from slow to fast over the states (A = -0.01 .. -1) and small steps (dt_proj's bias near -2): the state
    carries far, across scan chunks and prefill chunks."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".A_log"):
                p.copy_(torch.linspace(0.01, 1.0, p.numel()).log().view_as(p))
            elif name.endswith((".dt_proj.bias", ".dt_proj_bias")):  # Zamba's
                p.copy_(-2.0 + 0.5 * torch.randn(p.shape, generator=g))


def deepseek_config(kind: str, special: dict):
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig

    mla = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, moe_intermediate_size=32,
               tie_word_embeddings=False)
    if kind == "youtu":  # tied, as Youtu-LLM
        from transformers import YoutuConfig

        mla = {k: v for k, v in mla.items() if k not in ("n_routed_experts", "moe_intermediate_size")}
        return YoutuConfig(**_COMMON, **special, **{**mla, "tie_word_embeddings": True}, q_lora_rank=32,
                           rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "axk1":  # transformers 5.17 reads first_k_dense_replace, 5.23 mlp_layer_types: the same layers
        from transformers import AXK1Config

        return AXK1Config(**_COMMON, **special, **mla, q_lora_rank=32, n_shared_experts=1, first_k_dense_replace=1,
                          mlp_layer_types=["dense", "sparse", "sparse"], n_group=4, topk_group=2, norm_topk_prob=True,
                          num_experts_per_tok=2, routed_scaling_factor=2.5, rope_interleave=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "glm4-moe-lite":
        return Glm4MoeLiteConfig(**_COMMON, **special, **mla, q_lora_rank=32, n_shared_experts=1,
                                 mlp_layer_types=["dense", "sparse", "sparse"], n_group=4, topk_group=2,
                                 norm_topk_prob=True, num_experts_per_tok=2, routed_scaling_factor=2.5,
                                 rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "deepseek-v3":
        return DeepseekV3Config(**_COMMON, **special, **mla, q_lora_rank=32, n_shared_experts=1,
                                first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                                num_experts_per_tok=2, routed_scaling_factor=2.5, rope_interleave=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "deepseek-v2-group":
        return DeepseekV2Config(**_COMMON, **special, **mla, q_lora_rank=32, n_shared_experts=2,
                                first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                num_experts_per_tok=3, routed_scaling_factor=1.5,
                                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    return DeepseekV2Config(**_COMMON, **special, **mla, q_lora_rank=None, n_shared_experts=2,
                            first_k_dense_replace=0, topk_method="greedy", num_experts_per_tok=2,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 128, "beta_fast": 32,
                                             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0})


def dsa_config(kind: str, special: dict):
    import transformers

    dsa = dict(**_COMMON, **special, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, moe_intermediate_size=32,
               n_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"], n_group=4, topk_group=2,
               norm_topk_prob=True, num_experts_per_tok=2, routed_scaling_factor=2.5, tie_word_embeddings=False,
               index_n_heads=16, index_head_dim=16,
               index_topk=DSA_WIDE_TOPK if kind == "deepseek-v32-wide" else DSA_TOPK,
               rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if kind == "glm-moe-dsa":
        return transformers.GlmMoeDsaConfig(**dsa, indexer_types=["full", "shared", "full"])
    if kind == "hy-v4":
        return transformers.HYV4Config(**{**dsa, "rms_norm_eps": DSA_RMS_NORM_EPS},
                                       indexer_types=["full", "shared", "full"], hc_mult=3, hc_magnitude=1.5,
                                       hc_eps=1e-3, swiglu_limit=HY_V4_SWIGLU_LIMIT)
    if kind == "axk2":
        return transformers.AXK2Config(**{**dsa, "n_group": None, "topk_group": None}, gated_norm_rank=8)
    if kind == "dots3-note":
        rope = dsa.pop("rope_parameters")
        return transformers.Dots3NoteTextConfig(
            **{**dsa, "rms_norm_eps": DSA_RMS_NORM_EPS}, head_dim=24, shared_experts_intermediate_size=24,
            sliding_window=DOTS3_WINDOW,
            layer_types=["indexed_attention", "sliding_attention", "indexed_attention"], rope_theta=rope["rope_theta"],
            swa_rope_theta=1_000.0, swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=24,
            swa_kv_lora_rank=24, swa_head_dim=32, swa_qk_nope_head_dim=24, swa_v_head_dim=8)
    return transformers.DeepseekV32Config(**dsa)


def gemma4_config(kind: str, gemma: dict):
    """Gemma 4 on Gemma 2/3's test settings, with four layers, six for "gemma4-e" and "gemma4-unified" (the last one
    must be full), full layers' heads twice as wide as the sliding ones' and one KV head there."""
    from transformers import Gemma4TextConfig

    moe, e = kind == "gemma4-moe", kind == "gemma4-e"
    settings = {k: v for k, v in gemma.items() if k not in ("num_hidden_layers", "layer_types", "sliding_window")}
    if kind == "gemma4-unified":  # its config has no per-layer embedding or expert fields
        from transformers import Gemma4UnifiedTextConfig
        return Gemma4UnifiedTextConfig(**settings, **gemma4_layers(6), attention_k_eq_v=True, num_kv_shared_layers=2,
                                       use_double_wide_mlp=True)
    num_layers = 6 if e else 4
    return Gemma4TextConfig(
        **settings,
        **gemma4_layers(num_layers),
        attention_k_eq_v=kind == "gemma4",
        hidden_size_per_layer_input=8 if e else 0,
        vocab_size_per_layer_input=MODEL_VOCAB_SIZE,
        num_kv_shared_layers=2 if e else 0,
        use_double_wide_mlp=e,
        enable_moe_block=moe,
        **(dict(num_experts=4, top_k_experts=2, moe_intermediate_size=32) if moe else {}),
    )


def gemma4_layers(num_layers: int) -> dict:
    """Gemma 4's layer settings: sliding and full layers in turn, the full ones' heads wider, with one KV head and a
    rope turning a quarter of their frequencies."""
    return dict(num_hidden_layers=num_layers, layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
                sliding_window=SLIDING_WINDOW["gemma4"], global_head_dim=64, num_global_key_value_heads=1,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1_000_000.0}})


def _gemma3n_maps_per_layer_ids() -> bool:
    """Whether transformers' Gemma3nTextModel sends ids past its per-layer table to row 0 (5.23 does; 5.17 indexes
    the table with every id, so there the test model's table covers the whole vocabulary)."""
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextModel

    return "vocab_size_per_layer_input" in inspect.getsource(Gemma3nTextModel.get_per_layer_inputs)


def gemma3n_config(gemma: dict):
    """Gemma 3n on Gemma 2/3's test settings, with six layers (the last one must be full)."""
    from transformers import Gemma3nTextConfig

    settings = {k: v for k, v in gemma.items() if k not in ("num_hidden_layers", "layer_types", "intermediate_size")}
    return Gemma3nTextConfig(
        **settings,
        num_hidden_layers=6,
        layer_types=["sliding_attention", "full_attention"] * 3,
        intermediate_size=[128, 96, 128, 96, 128, 128],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=400 if _gemma3n_maps_per_layer_ids() else MODEL_VOCAB_SIZE,
        num_kv_shared_layers=2,
        altup_num_inputs=4,
        laurel_rank=8,
        activation_sparsity_pattern=[0.95, 0.6, 0.0, 0.0, 0.0, 0.0],
    )


def _randomize_gemma4_(model, seed: int) -> None:
    """Gemma 4's router scales (per input feature, per expert) and its layers' output scalars (a buffer) near 1,
    each its own: a forgotten one shows."""
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, t in sorted(model.state_dict(keep_vars=True).items()):
            if name.endswith(("router.scale", "router.per_expert_scale", "layer_scalar")):
                t.copy_(1.0 + NORM_NOISE * torch.randn(t.shape, generator=g))


def randomize_global_scales_(model, seed: int) -> None:
    """Inkling's MLP and router `global_scale` (ones in transformers), as the norms' weights: 1 + noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("global_scale"):
                p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=g))


def randomize_inkling2_(model, seed: int, query_std: float = 1.0) -> None:
    """Inkling-2's clips' scales (ones in transformers) as the norms' weights, its depth-softmax queries (zeros) of
    query_std: the softmaxes over depth far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("l2_clip.scale"):
                p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=g))
            elif name.endswith(".query"):
                p.copy_(query_std * torch.randn(p.shape, generator=g))


def randomize_inkling2_loop_(model, seed: int) -> None:
    """Inkling-2's randomization, its queries of INKLING2_LOOP_QUERY_STD; the message gates' down_proj of
    INKLING2_LOOP_GATE_DOWN_STD."""
    randomize_inkling2_(model, seed, INKLING2_LOOP_QUERY_STD)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("_message_gate.down_proj.weight"):
                p.copy_(INKLING2_LOOP_GATE_DOWN_STD * torch.randn(p.shape, generator=g))


def _randomize_zero_centered_norms_(model, seed: int) -> None:
    """Qwen3-Next and Gemma 3 RMSNorms (all but Qwen3-Next's gated one) scale by 1 + weight, so their weights become
    NORM_NOISE * N(0,1); slow decays on some linear-attention heads (e^g near 1) carry the state far, across chunks."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                p.copy_(NORM_NOISE * torch.randn(p.shape, generator=g))
            elif name.endswith("linear_attn.A_log"):
                p.copy_(torch.linspace(0.01, 1.0, p.numel()).log())
            elif name.endswith("linear_attn.dt_bias"):
                p.copy_(-2.0 + 0.5 * torch.randn(p.shape, generator=g))


def _randomize_kda_(model, seed: int, rates: tuple[float, float] = (0.01, 1.0)) -> None:
    """Kimi Delta Attention's decays from almost none to fast: head rates e^A_log spread over `rates` (Kimi's: times
    softplus of channel biases near -2; Ling's bounded gate: in a sigmoid of the rate times the biased input), so
    some channels carry the state far, across chunks."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".A_log"):
                p.copy_(torch.linspace(*rates, p.numel()).log().view(p.shape))
            elif name.endswith(".dt_bias"):
                p.copy_(-2.0 + 0.5 * torch.randn(p.shape, generator=g))


def chameleon_image_token_name(code: int) -> str:
    """The vocabulary_map name of VQ code `code` as a token: its digits as the letters A-J, as Chameleon's tokenizer
    spells them (transformers' ChameleonImageVocabularyMapping reads them back)."""
    return "IMGIMG" + "".join(chr(ord("A") + int(digit)) for digit in str(code)) + "Z"


def chameleon_config(kind: str, special: dict):
    """See CHAMELEON_KINDS: one flat config (no text_config), its tiny VQ model and a vocabulary_map whose image
    tokens are CHAMELEON_IMAGE_TOKENS, the "<image>" placeholder past them (not an image token: never suppressed)."""
    from transformers import ChameleonConfig

    vocabulary_map = {chameleon_image_token_name(code): token for code, token in enumerate(CHAMELEON_IMAGE_TOKENS)}
    vocabulary_map |= {"<image>": CHAMELEON_IMAGE_TOKENS[-1] + 1}
    swin = kind == "chameleon-swin"
    return ChameleonConfig(**{**_COMMON, "rms_norm_eps": CHAMELEON_RMS_NORM_EPS}, **special, num_attention_heads=4,
                           num_key_value_heads=1 if swin else 2, tie_word_embeddings=False, attention_bias=not swin,
                           mlp_bias=swin, swin_norm=swin, vocabulary_map=vocabulary_map, vq_config=CHAMELEON_VQ,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})


def _sharpen_gpt_oss_(model, seed: int) -> None:
    """GPT-OSS's sinks and expert gate/up weights at the scales where a missing sink or clamp shows."""
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".sinks"):
                p.copy_(GPT_OSS_SINK_STD * torch.randn(p.shape, generator=g))
            elif name.endswith(".experts.gate_up_proj"):
                p.copy_(GPT_OSS_GATE_UP_STD * torch.randn(p.shape, generator=g))


def _randomize_ngpt_scales_(model, seed: int) -> None:
    """Dory's nGPT scales (see its comment above NEWEST_FAMILIES): at transformers' initial values times 1 + noise, of
    random sign where transformers squares them (sqk, s_gate) or takes their magnitude (lambda_1, lambda_2); the logit
    scales DORY_LOGIT_SCALE times theirs."""
    g = torch.Generator().manual_seed(seed)
    init = model.config.initializer_range
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = 1.0 + NORM_NOISE * torch.randn(p.shape, generator=g)
            sign = torch.randint(0, 2, p.shape, generator=g) * 2.0 - 1.0
            if name.endswith((".sqk", ".s_gate", ".lambda_1", ".lambda_2")):
                p.copy_(init * noise * sign)
            elif name.endswith((".suv_gate", ".suv_up")):
                p.copy_(noise)
            elif name.endswith(".logit_scale"):
                p.copy_(init * DORY_LOGIT_SCALE * noise)


def _randomize_(model, seed: int) -> None:
    """Re-initialise all parameters deterministically (independent of HF init order)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".bias"):  # the LayerNorms' too
                p.copy_(BIAS_STD * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=g))
            else:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=g))


def _randomize_bert_decoder_(model, seed: int) -> None:
    """_randomize_ by the BERT decoders' names: their LayerNorms' (`LayerNorm`, `layer_norm`, Megatron-BERT's `ln`) as
    norms, the rest by suffix alone (RoBERTa-PreLayerNorm's prefix `roberta_prelayernorm.` names every tensor)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".bias"):
                p.copy_(BIAS_STD * torch.randn(p.shape, generator=g))
            elif name.endswith(("LayerNorm.weight", "layer_norm.weight", ".ln.weight")):
                p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=g))
            else:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=g))
        for module in model.modules():  # RoFormer's sinusoid table: transformers' own, as its checkpoints hold it
            if hasattr(module, "create_weight"):
                module.weight.copy_(module.create_weight())


def randomize_correction_biases_(model, seed: int, std: float = 0.3) -> None:
    """The routers' correction biases (V3's, LFM2-MoE's): buffers, saved with the weights, that _randomize_ misses."""
    g = torch.Generator().manual_seed(seed)
    for name, buffer in model.named_buffers():
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            buffer.copy_(std * torch.randn(buffer.shape, generator=g))


# Text configs that AutoModelForCausalLM does not take (it maps their multimodal wrappers' configs, or, Mistral 4's,
# only AutoModelForImageTextToText maps it): their class. Chameleon's language model has no class of its own: its
# wrapper's.
_CAUSAL_LM_CLASSES = {"mllama_text_model": "MllamaForCausalLM", "emu3_text_model": "Emu3ForCausalLM",
                      "mistral4": "Mistral4ForCausalLM", "chameleon": "ChameleonForConditionalGeneration"}


# The BERT decoders whose transformers 5.17 module attends bidirectionally as a decoder, by their module's name.
BIDIRECTIONAL_IN_5_17 = {"megatron-bert-lmhead": "megatron_bert", "big-bird-lmhead": "big_bird",
                         "rembert-lmhead": "rembert", "roformer-lmhead": "roformer"}


def unusable_reference(kind: str) -> str | None:
    """Why the installed transformers cannot be the reference for `kind`, or None. transformers 5.17's Doge lets SDPA
    skip the causal mask and then adds its dynamic mask onto none: its prefill sees later tokens (5.23 keeps the mask).
    Its Cohere Compass reorders the leading rope frequencies: the same checkpoint rotates otherwise than under 5.23.
    5.23's and 5.17's HY-V4 rotate halves of its heads where 5.25's (and the engine) rotate interleaved pairs. 5.17's
    Megatron-BERT, BigBird, RemBERT and RoFormer build a bidirectional mask whatever `is_decoder` says (5.25's a causal
    one as decoders)."""
    import transformers
    if kind == "cohere-compass":
        from transformers.models.cohere_compass import modeling_cohere_compass
        if "inv_freq_3d" in inspect.getsource(modeling_cohere_compass.CohereCompassRotaryEmbedding):
            return (f"transformers {transformers.__version__}'s Cohere Compass permutes its rope frequencies "
                    f"(pre-rotated for its multimodal rope; 5.23's and later ones do not)")
    if kind == "hy-v4":
        from transformers.models.hy_v4 import modeling_hy_v4
        if "apply_rotary_pos_emb_interleave" not in inspect.getsource(modeling_hy_v4):
            return (f"transformers {transformers.__version__}'s HY-V4 ropes halves of its heads (5.25's, which the "
                    f"engine follows, interleaved pairs)")
    if kind in BIDIRECTIONAL_IN_5_17:
        family = BIDIRECTIONAL_IN_5_17[kind]
        if "create_causal_mask" not in inspect.getsource(importlib.import_module(f"transformers.models.{family}."
                                                                                 f"modeling_{family}")):
            return (f"transformers {transformers.__version__}'s {family} attends to later tokens as a decoder (5.25's "
                    f"masks them)")
    if kind == "doge":
        from transformers.models.doge import modeling_doge
        if "allow_is_causal_skip" not in inspect.getsource(modeling_doge.DogeModel.forward):
            return f"transformers {transformers.__version__}'s Doge attends to later tokens in a prefill (the reference)"
    return None


def causal_lm_class(model_type: str) -> type:
    """transformers' causal-LM class for a config's model_type: AutoModelForCausalLM, or the class it does not map."""
    import transformers

    name = _CAUSAL_LM_CLASSES.get(model_type)
    return transformers.AutoModelForCausalLM if name is None else getattr(transformers, name)


def build_model(kind: str, dir, *, save_sharded: bool | None = None) -> pathlib.Path:
    """Build a tiny random fp32 model of `kind` in `dir` (weights, config, tokenizer,
    generation_config.json). Deterministic. "qwen3-sharded" has the exact same weights as
    "qwen3" but is saved as several safetensors shards + model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    dir = pathlib.Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    if save_sharded is None:
        save_sharded = kind == "qwen3-sharded"
    base_kind = "qwen3" if kind == "qwen3-sharded" else kind

    config = make_config(kind)
    torch.manual_seed(_SEEDS[base_kind])
    cls = causal_lm_class(config.model_type)
    model = (cls.from_config if cls is AutoModelForCausalLM else cls._from_config)(config, dtype=torch.float32)
    _randomize_(model, _SEEDS[base_kind])
    if kind in QWEN3_NEXT_KINDS + ("gemma3", "gemma2", "gemma", "vaultgemma", "minimax-m3", "recurrent-gemma",
                                      "qwen4-exp"):
        _randomize_zero_centered_norms_(model, _SEEDS[base_kind])
    if kind in GEMMA4_KINDS:
        _randomize_gemma4_(model, _SEEDS[base_kind])
    if kind in ("gpt-oss", "granite-swa", "granitemoe-swa", "flint", "mimo-v2-flash", "hy-v4", "deepseek-v4"):
        _sharpen_gpt_oss_(model, _SEEDS[base_kind])
    if kind == "deepseek-v4":  # the hash layer's table: 2 distinct experts per token id
        g = torch.Generator().manual_seed(_SEEDS[base_kind] + 5)
        for name, buffer in model.named_buffers():
            if name.endswith(".tid2eid"):
                buffer.copy_(torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:buffer.shape[1]]
                                          for _ in range(buffer.shape[0])]))
    if kind in SSM_KINDS + MAMBA2_HYBRID_KINDS:
        _randomize_mamba_(model, _SEEDS[base_kind])
    if kind == "recurrent-gemma":  # decays from none (softplus of -9: a = e^(-8 r 1e-4)) to fast
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("rg_lru.recurrent_param"):
                    p.copy_(torch.linspace(-9.0, 1.0, p.numel()))
    if kind == "rwkv":
        _randomize_rwkv_(model, _SEEDS[base_kind])
    if kind in ("zamba", "zamba2", "hrm-text"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(("model.layers.", "model.L_module.", "model.H_module.")) and p.dim() > 1:
                    p.mul_(ZAMBA2_LAYER_WEIGHT_SCALE)
    if kind in MAMBA1_KINDS:
        _randomize_mamba1_(model, _SEEDS[base_kind])
    if kind == "kimi-linear":
        _randomize_kda_(model, _SEEDS[base_kind])
    if kind == "bailing-hybrid":
        _randomize_kda_(model, _SEEDS[base_kind], rates=(1.0, 16.0))
    if kind == "zaya":  # its scales and key temperatures near 1, as the norms' weights; the router's skip logits and
        # the experts' balancing biases (the skip's stays at -1: transformers sets it so after loading, whatever the
        # checkpoint holds)
        g = torch.Generator().manual_seed(_SEEDS[base_kind] + 4)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                if name.endswith(("_scale", ".temp")):
                    p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=g))
                elif name.endswith("router_mlp.out_proj.weight"):
                    p[-1] *= ZAYA_SKIP_LOGIT_SCALE
            for name, buffer in sorted(model.named_buffers()):
                if name.endswith("balancing_biases"):
                    buffer[:-1] = ZAYA_BALANCING_BIAS_MEAN + ZAYA_BALANCING_BIAS_STD * torch.randn(
                        buffer.shape[0] - 1, generator=g)
    if kind == "doge":  # the dynamic mask's A, and the residual scales near 1 (as the norms' weights)
        g = torch.Generator().manual_seed(_SEEDS[base_kind] + 4)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                if name.endswith(".self_attn.A"):
                    p.copy_(DOGE_A_STD * torch.randn(p.shape, generator=g))
                elif name.endswith("_residual"):
                    p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=g))
    # Norms that _randomize_ does not know by name, as the others': MPT's (norm_1, norm_2, norm_f), HyperCLOVAX's
    # post_norm1 and post_norm2, OpenAI GPT's ln_1 and ln_2 (after every sublayer: weights of INIT_STD would shrink
    # the stream to nothing), xLSTM's norm_mlstm and norm_ffn.
    if kind in ("mpt", "hyperclovax", "openai-gpt", XLSTM_KIND):
        g = torch.Generator().manual_seed(_SEEDS[base_kind] + 4)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                if ".norm_" in name or ".post_norm" in name or (".ln_" in name and name.endswith(".weight")):
                    p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=g))
    if kind in BERT_DECODER_KINDS:
        _randomize_bert_decoder_(model, _SEEDS[base_kind])
    if kind == "axk2":  # its norms' gate MLPs, which _randomize_ took for norm weights (1 + noise), as linears
        g = torch.Generator().manual_seed(_SEEDS[base_kind] + 4)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                if "layernorm.mlp." in name:
                    p.copy_(INIT_STD * torch.randn(p.shape, generator=g))
    if kind == XLSTM_KIND:
        with torch.no_grad():
            for block in model.backbone.blocks:
                block.mlstm_layer.fgate_preact.bias.add_(XLSTM_FORGET_BIAS)
    if kind == "inkling":
        randomize_global_scales_(model, _SEEDS[base_kind] + 4)
    if kind == "inkling2":
        randomize_inkling2_(model, _SEEDS[base_kind] + 4)
    if kind == "inkling2-loop":
        randomize_inkling2_loop_(model, _SEEDS[base_kind] + 4)
    if kind == "dory":
        _randomize_ngpt_scales_(model, _SEEDS[base_kind] + 4)
    if kind in ("marian", "pegasus"):  # their fixed sinusoidal table, which _randomize_ took for a weight
        with torch.no_grad():
            positions = model.model.decoder.embed_positions
            positions.weight.copy_(positions.create_weight())
    if kind == "youtu":  # transformers' Youtu zeroes the pad token's embedding when it loads a checkpoint: saved so
        with torch.no_grad():
            model.get_input_embeddings().weight[config.pad_token_id] = 0.0
    randomize_correction_biases_(model, _SEEDS[base_kind] + 2,
                                 LONGCAT_CORRECTION_BIAS_STD if kind == "longcat-flash" else 0.3)
    if config.tie_word_embeddings and kind != "bigbird-pegasus":  # its *ForCausalLM never ties
        assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    model.eval()
    model.save_pretrained(str(dir), max_shard_size=SHARD_SIZE if save_sharded else "50GB")

    tok = build_tokenizer(dir)
    ids = _token_ids()
    assert tok.convert_tokens_to_ids(EOS_TOKEN) == ids[EOS_TOKEN]
    eos = [ids[EOS_TOKEN], ids[IM_END]] if kind == "llama" else ids[EOS_TOKEN]
    gen_cfg = {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": eos,
        "pad_token_id": ids[PAD_TOKEN],
        "do_sample": False,
    }
    (dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return dir


# --------------------------------------------------------------------------------------
# Hugging Face reference
# --------------------------------------------------------------------------------------

_HF_CACHE: dict[tuple[str, torch.dtype], object] = {}


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def hf_attention(model_dir, attn_implementation: str | None = None) -> dict:
    """from_pretrained's attention argument: the one asked for, else eager where the model softcaps its scores (Gemma
    2). transformers 5.17's Gemma 2 defaults to SDPA, which drops the softcap without a word (5.23 refuses SDPA for
    it)."""
    if attn_implementation is not None:
        return {"attn_implementation": attn_implementation}
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    return {"attn_implementation": "eager"} if config.get("attn_logit_softcapping") is not None else {}


def load_hf_model(model_dir, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """Load (and cache per process) the transformers model for `model_dir` on the CPU in `dtype` (fp32 unless told):
    a vision-language checkpoint as transformers' conditional-generation model (see test_vlm_text.py); its attention
    as hf_attention says."""
    from transformers import AutoModelForImageTextToText

    from nanoinfer.models.registry import is_vision_language

    _quiet_transformers()
    path = str(pathlib.Path(model_dir).resolve())
    key = (path, dtype, attn_implementation)
    if key not in _HF_CACHE:
        config = json.loads((pathlib.Path(path) / "config.json").read_text())
        vision_language = is_vision_language(config.get("architectures"))
        auto = AutoModelForImageTextToText if vision_language else causal_lm_class(config["model_type"])
        m = auto.from_pretrained(path, dtype=dtype, **hf_attention(path, attn_implementation))
        m.eval()
        _HF_CACHE[key] = m
    return _HF_CACHE[key]


_HF_GREEDY: dict[tuple, list[dict]] = {}


def cached_hf_greedy(model_dir, prompts_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[dict]:
    """hf_greedy, computed once per (model, prompts, length) in a test process: several tests share a reference."""
    key = (str(model_dir), max_new_tokens, tuple(map(tuple, prompts_token_ids)))
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = hf_greedy(model_dir, prompts_token_ids, max_new_tokens)
    return _HF_GREEDY[key]


@torch.inference_mode()
def hf_greedy(model_dir, prompts_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[dict]:
    """Greedy-decode each prompt separately with transformers (fp32, KV cache, no EOS stop); `model_dir` may also
    be a loaded model (any device and dtype: the logits come back as float32 on the CPU).

    Returns, per prompt, a dict with
      "token_ids":      list[int] of length max_new_tokens,
      "logits":         float32 Tensor [max_new_tokens, vocab]; row i is the distribution
                        from which token_ids[i] was chosen (argmax),
      "prefill_logits": float32 Tensor [vocab], logits at the prompt's last position
                        (== logits[0]).
    """
    from transformers import DynamicCache

    model = model_dir if isinstance(model_dir, torch.nn.Module) else load_hf_model(model_dir)
    # Mamba's models (transformers' modeling_mamba.py, falcon_mamba) name their cache `cache_params` and build it
    # themselves on the first call (a MambaCache in older transformers, which then needs cache_position); RWKV's, a
    # list it builds too, is `state`. transformers 5.25 renames them all but RWKV's `cache` (5.23's others:
    # `past_key_values`), in its outputs too.
    parameters = inspect.signature(model.forward).parameters
    cache_kw = next((kw for kw in ("cache_params", "state", "past_key_values", "cache") if kw in parameters), None)
    if cache_kw is None:
        return [hf_greedy_uncached(model, prompt, max_new_tokens) for prompt in prompts_token_ids]
    device = model.device
    derives_positions = (hasattr(getattr(model.base_model, "embeddings", None), "create_position_ids_from_input_ids")
                         or model.config.model_type == "kosmos-2.5")
    results = []
    for prompt in prompts_token_ids:
        prompt = [int(t) for t in prompt]
        assert len(prompt) > 0, "empty prompt"
        # MiniMax's model builds its own cache class (and refuses a DynamicCache), as xLSTM's does under 5.25.
        own_cache = cache_kw in ("cache_params", "state") or model.config.model_type in ("minimax", "xlstm")
        cache = None if own_cache else DynamicCache(config=model.config)
        if hasattr(model, "_setup_cache"):
            # RecurrentGemma keeps its recurrent state in its modules, zeroed only when it makes its cache itself: a
            # one-token prompt would run on from the last prompt's conv state (longer ones overwrite it). Fresh.
            model._setup_cache(model.config, 1, device, model.dtype)
        input_ids = torch.tensor([prompt], dtype=torch.long, device=device)
        out = model(input_ids=input_ids, **{cache_kw: cache}, use_cache=True)
        cache = getattr(out, cache_kw, cache)  # RecurrentGemma's output holds none: it updates its DynamicCache
        step_logits = out.logits[0, -1].float().to("cpu", copy=True)
        prefill_logits = step_logits.clone()
        tokens: list[int] = []
        all_logits = []
        for i in range(max_new_tokens):
            all_logits.append(step_logits)
            nxt = int(torch.argmax(step_logits))
            tokens.append(nxt)
            if i == max_new_tokens - 1:
                break
            pos = len(prompt) + i
            # Positions derived from the ids (RoBERTa's layout, from pad_token_id + 1; Kosmos-2.5's sinusoidal rows, as
            # its generate() leaves them): given, they would be taken as they are.
            positions = {} if derives_positions else {"position_ids": torch.tensor([[pos]], dtype=torch.long,
                                                                                    device=device)}
            out = model(
                input_ids=torch.tensor([[nxt]], dtype=torch.long, device=device),
                **{cache_kw: cache},
                use_cache=True,
                **positions,
                cache_position=torch.tensor([pos], dtype=torch.long, device=device),
            )
            cache = getattr(out, cache_kw, cache)
            step_logits = out.logits[0, -1].float().to("cpu", copy=True)
        logits = (
            torch.stack(all_logits)
            if all_logits
            else torch.empty(0, model.config.vocab_size, dtype=torch.float32)
        )
        results.append({"token_ids": tokens, "logits": logits, "prefill_logits": prefill_logits})
    return results


def hf_greedy_uncached(model, prompt: Sequence[int], max_new_tokens: int) -> dict:
    """hf_greedy's result for one prompt, from a model without a KV cache (OpenAI GPT's): each step a forward over
    the whole sequence so far."""
    ids = [int(t) for t in prompt]
    all_logits = []
    for _ in range(max_new_tokens):
        out = model(input_ids=torch.tensor([ids], dtype=torch.long, device=model.device))
        all_logits.append(out.logits[0, -1].float().to("cpu", copy=True))
        ids.append(int(torch.argmax(all_logits[-1])))
    return {"token_ids": ids[len(prompt):], "logits": torch.stack(all_logits), "prefill_logits": all_logits[0].clone()}


@torch.inference_mode()
def hf_forward_logits(model_dir, token_ids: Sequence[int]) -> torch.Tensor:
    """Plain transformers forward (no cache) over `token_ids`: float32 Tensor [len, vocab]."""
    model = load_hf_model(model_dir)
    out = model(input_ids=torch.tensor([[int(t) for t in token_ids]], dtype=torch.long), use_cache=False)
    return out.logits[0].float().clone()


@torch.inference_mode()
def hf_encoder_states(model_dir, token_ids: Sequence[int]) -> torch.Tensor:
    """transformers' decoder run as an encoder: final-norm hidden states [len, hidden], float32.

    Bidirectional: a 4-D boolean mask is used as given (no causal mask is built on top) and all True lets every
    token see every other. No position encoding: all position ids 0 make every rotation the identity (cos 1,
    sin 0; the test models' rope types have attention scaling 1)."""
    model = load_hf_model(model_dir)
    n = len(token_ids)
    out = model.model(input_ids=torch.tensor([[int(t) for t in token_ids]], dtype=torch.long),
                      attention_mask=torch.ones(1, 1, n, n, dtype=torch.bool),
                      position_ids=torch.zeros(1, n, dtype=torch.long), use_cache=False)
    return out.last_hidden_state[0].float().clone()


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """Gap between the largest and second-largest logit along the last dim."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def assert_greedy_match(ours: Sequence[int], ref_tokens: Sequence[int], ref_logits: torch.Tensor, tol: float = 1e-4) -> None:
    """Compare a greedy continuation against the HF reference.

    Passes if identical. If they first differ at step i, passes only if the reference
    top-2 logit gap at step i is < tol (a genuine near-tie; later steps are not compared).
    Lengths must match unless the difference is excused by such a near-tie.
    """
    ours = [int(t) for t in ours]
    ref_tokens = [int(t) for t in ref_tokens]
    n = min(len(ours), len(ref_tokens))
    for i in range(n):
        if ours[i] != ref_tokens[i]:
            row = ref_logits[i].float()
            gap = float(top2_gaps(row))
            if gap < tol:
                return
            raise AssertionError(
                f"greedy mismatch at step {i}: ours={ours[i]} ref={ref_tokens[i]}; "
                f"ref top-2 gap={gap:.3e} >= tol={tol:.1e}; "
                f"ref logit[ours]={float(row[ours[i]]):.6f} ref logit[ref]={float(row[ref_tokens[i]]):.6f}\n"
                f"ours={ours}\nref ={ref_tokens}"
            )
    if len(ours) != len(ref_tokens):
        raise AssertionError(
            f"length mismatch: ours has {len(ours)} tokens, ref has {len(ref_tokens)} "
            f"(first {n} agree)\nours={ours}\nref ={ref_tokens}"
        )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights as held in memory (oneDNN-packed copies included), norms aside."""
    seen, total = set(), 0
    for module in model.modules():
        if "Norm" in type(module).__name__:
            continue
        tensors = [*module.parameters(recurse=False), getattr(module, "packed_weight", None)]
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def random_prompts(n: int, vocab_lo: int, vocab_hi: int, len_lo: int, len_hi: int, seed: int) -> list[list[int]]:
    """`n` prompts of token ids uniform in [vocab_lo, vocab_hi), lengths uniform in
    [len_lo, len_hi] (both inclusive). Deterministic in `seed`."""
    assert 0 <= vocab_lo < vocab_hi and 1 <= len_lo <= len_hi
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(len_lo, len_hi))]
        for _ in range(n)
    ]


# What the engine is compared with transformers on (test_correctness; the same on CUDA, where transformers' tokens come
# from the same cache): lengths straddle 16-token blocks, and a one-token prompt.
REFERENCE_PROMPTS = random_prompts(6, 5, 440, 2, 90, seed=7) + [[17]]
REFERENCE_MAX_TOKENS = 24


def check_against_hf(outputs, refs: list[dict], captured: dict[int, list[torch.Tensor]] | None = None) -> float:
    """Assert each output's greedy tokens match the reference (see assert_greedy_match); with the engine's
    captured logits, return the max |logit difference| over the steps up to the first divergence."""
    worst = 0.0
    for request, ref in zip(outputs, refs):
        out = request.outputs[0]
        assert_greedy_match(out.token_ids, ref["token_ids"], ref["logits"])
        if captured is not None:
            ours = head_logits(torch.stack(captured[request.request_id]).cpu(), ref["logits"].shape[-1])
            steps = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref["token_ids"])) if a != b),
                         len(ref["token_ids"]) - 1) + 1
            worst = max(worst, (ours[:steps] - ref["logits"][:steps]).abs().max().item())
    return worst


def head_logits(ours: torch.Tensor, width: int) -> torch.Tensor:
    """Our logits [..., vocab] where transformers' LM head has `width` rows (Apertus 1.5's pruned head): the first
    width, after checking that those past it are -inf (never sampled)."""
    if ours.shape[-1] > width:
        assert torch.all(ours[..., width:] == -math.inf), "logits past the model's LM head are not all -inf"
    return ours[..., :width]


# bf16 against transformers in bf16, both measured against transformers' own bf16 rounding error at each step
# (its bf16 logits minus its fp32 logits on the same tokens, the larger of its default and its eager attention's;
# ~0.1-0.3 on these models, several bf16 steps): before
# any divergence our logits stay within BF16_ERROR_RATIO times that error of its bf16 ones (0.7x typical, 2.3x at
# worst on the CPU; 0.1-0.4x on Llama, Qwen and Mistral since their rope rounds as transformers' does), and a
# divergence passes only where its top-2 gap is within twice that error, i.e. where rounding alone can swap them (on
# the CPU every divergence sat below half of that).
BF16_ERROR_RATIO = 4


def bf16_ulp(x: float) -> float:
    """The distance between neighbouring bfloat16 numbers at |x|."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


@torch.inference_mode()
def hf_bf16_error(fp32_model: torch.nn.Module, eager_bf16_model: torch.nn.Module, prompt: list[int], ref: dict
                  ) -> list[float]:
    """Per generated step, how far transformers' bf16 logits are from its fp32 logits (`fp32_model`, on any device)
    for the same tokens, the larger of its two bf16 paths' (`ref`, from hf_greedy, and `eager_bf16_model`, its eager
    attention), at least one bf16 step of the largest: the rounding error bf16 itself brings. Both paths: one can land
    near the fp32 logits at a step where the other is far (Doge's tiny model at one step: transformers' SDPA path
    0.06 from its fp32 logits, its eager path 0.28, ours 0.28). The logits a model suppresses (Chameleon's image
    tokens: its dtype's minimum, fp32's here and bf16's there) carry no rounding error: measured over the others."""
    tokens = torch.tensor([prompt + ref["token_ids"][:-1]], device=fp32_model.device)
    fp32 = fp32_model(input_ids=tokens).logits[0, len(prompt) - 1:].float().cpu()
    eager = eager_bf16_model(input_ids=tokens.to(eager_bf16_model.device)).logits[0, len(prompt) - 1:].float().cpu()
    kept = fp32 > torch.finfo(torch.float32).min
    return [max((b - f)[k].abs().max().item(), (e - f)[k].abs().max().item(), bf16_ulp(b[k].abs().max().item()))
            for b, e, f, k in zip(ref["logits"], eager, fp32, kept)]


def check_bf16_against_hf(tokens: list[int], logits: torch.Tensor, ref: dict, error: list[float]) -> float:
    """Until our tokens leave transformers' (bf16) ones, our logits stay within BF16_ERROR_RATIO x its own bf16
    error of its logits; where they leave, its top-2 gap is within twice that error. Returns the largest
    |ours - transformers'| in units of that error."""
    ref_tokens, ref_logits = ref["token_ids"], ref["logits"]
    diverged = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    steps = len(tokens) if diverged is None else diverged + 1
    worst = 0.0
    for i in range(steps):
        ratio = (logits[i] - ref_logits[i]).abs().max().item() / error[i]
        assert ratio <= BF16_ERROR_RATIO, (f"step {i}: logits differ from transformers' by {ratio:.1f}x its own bf16 "
                                           f"error ({error[i]:.3g})")
        worst = max(worst, ratio)
    if diverged is not None:
        top = ref_logits[diverged].topk(2).values.tolist()
        assert top[0] - top[1] <= 2 * error[diverged], (
            f"bf16 divergence at step {diverged} where transformers' top-2 gap {top[0] - top[1]:.4g} exceeds twice "
            f"its own bf16 error ({error[diverged]:.4g}): ours {tokens}, transformers {ref_tokens}")
    return worst


def check_bf16_outputs(outputs, prompts: Sequence[Sequence[int]], refs: list[dict],
                       captured: dict[int, list[torch.Tensor]], fp32_model: torch.nn.Module,
                       eager_bf16_model: torch.nn.Module) -> float:
    """check_bf16_against_hf for every output of the engine's bf16 run on `prompts` (its captured logits) against
    transformers' bf16 references `refs`, its own error measured by `fp32_model` and `eager_bf16_model` (see
    hf_bf16_error): the largest ratio."""
    worst = 0.0
    for prompt, out, ref in zip(prompts, outputs, refs):
        logits = torch.stack(captured[out.request_id]).float().cpu()
        error = hf_bf16_error(fp32_model, eager_bf16_model, list(prompt), ref)
        worst = max(worst, check_bf16_against_hf(out.outputs[0].token_ids, logits, ref, error))
    return worst


def shared_prefix_prompts() -> list[list[int]]:
    """4 prompts of 41 to 70 tokens that share their first 40."""
    shared = random_prompts(1, 5, 440, 40, 40, seed=8)[0]
    return [shared + tail for tail in random_prompts(4, 5, 440, 1, 30, seed=9)]


@torch.inference_mode()
def hf_reordering_noise(model_dir, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        refs: list[dict] | None = None) -> float:
    """transformers' own fp32 rounding under a reordering of the same sums: the max |difference| between the logits
    of its cached greedy decode and those of one uncached pass over the prompt and the generated tokens. A model
    that amplifies rounding (Gemma 4 E's attention: q/k-normed and unscaled) shows it here as it does in a chunked
    engine run, whose chunks reorder the sums in the same way. `model_dir` may also be a loaded model (on any device),
    with `refs`, its hf_greedy results for the prompts."""
    model = model_dir if isinstance(model_dir, torch.nn.Module) else load_hf_model(model_dir)
    refs = cached_hf_greedy(model_dir, prompts, max_new_tokens) if refs is None else refs
    worst = 0.0
    for prompt, ref in zip(prompts, refs):
        ids = list(prompt) + ref["token_ids"][:-1]
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, len(prompt) - 1:].float().cpu()
        worst = max(worst, (logits - ref["logits"]).abs().max().item())
    return worst


def chunked_prefix_preemption_logit_diff(model_dir, captured: dict[int, list[torch.Tensor]], max_tokens: int,
                                         tensor_parallel_size: int = 1) -> float:
    """The engine with 7-token chunks, a shared 40-token prefix and a cache too small for all the sequences at once,
    twice, against transformers: asserts the tokens (check_against_hf), that the second run hit the cached prefix
    and that preemption happened; returns the max |logit difference| over both runs."""
    from nanoinfer import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = shared_prefix_prompts()
    with LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=96, max_num_batched_tokens=7,
             kvcache_block_size=8, num_kvcache_blocks=14, tensor_parallel_size=tensor_parallel_size) as llm:
        first = llm.generate(prompts, greedy, use_tqdm=False)
        second = llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0 and all(o.num_cached_tokens >= 40 for o in second)
    refs = cached_hf_greedy(model_dir, prompts, max_tokens)
    return max(check_against_hf(first, refs, captured), check_against_hf(second, refs, captured))


# --------------------------------------------------------------------------------------
# Encoder-only models (BERT, RoBERTa, XLM-RoBERTa)
# --------------------------------------------------------------------------------------

# Each built as transformers' `<Family>Model` (num_labels None) or `<Family>ForSequenceClassification`.
ENCODER_KINDS = ("bert", "roberta", "xlm-roberta", "modernbert")
ENCODER_MAX_POSITIONS = 128  # the longest prompt (RoBERTa's tables hold 2 rows more: positions start at pad + 1)
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ids 0..4
ROBERTA_SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4: pad 1, as RoBERTa's
_ENCODER_SEEDS = {"bert": 6913, "roberta": 7024, "xlm-roberta": 8135, "modernbert": 9246}
# ModernBERT: layers 0 and 3 global, 1 and 2 local, each token seeing those within 6 positions (shorter than most
# test prompts), and rope thetas far apart, so that a lost window or one theta for both shows.
MODERNBERT_LOCAL_ATTENTION = 12
MODERNBERT_ROPE_THETAS = {"global_rope_theta": 20_000.0, "local_rope_theta": 50.0}


def _bert_tokenizer():
    """A WordPiece tokenizer with BERT's specials and pair template: [CLS] a [SEP] (type 0) b [SEP] (type 1). Its
    vocabulary is written out (the corpus's words, its characters alone and as ##-continuations), not trained:
    tokenizers' WordPieceTrainer breaks ties differently from run to run."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words = {w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(_CORPUS))}
    chars = sorted({c for w in words for c in w})
    vocab = BERT_SPECIAL_TOKENS + chars + [f"##{c}" for c in chars] + sorted(words - set(chars))
    assert len(vocab) <= MODEL_VOCAB_SIZE
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=ENCODER_MAX_POSITIONS,
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def _roberta_tokenizer():
    """Byte-level BPE with RoBERTa's specials and pair template <s> a </s></s> b </s> (no token types)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _train_tokenizer_object(ROBERTA_SPECIAL_TOKENS)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
                                   model_max_length=ENCODER_MAX_POSITIONS,
                                   model_input_names=["input_ids", "attention_mask"])


def _modernbert_tokenizer():
    """Byte-level BPE with BERT's specials and ModernBERT's templates: [CLS] a [SEP] b [SEP] (no token types)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _train_tokenizer_object(BERT_SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=ENCODER_MAX_POSITIONS,
                                   model_input_names=["input_ids", "attention_mask"])


def _modernbert_config(num_labels: int | None):
    """4 layers (global, local, local, global); the classifier pools the mean and has every bias (norms, attention,
    MLP, head), the embedder none, as the released embedders."""
    from transformers import ModernBertConfig

    biases = num_labels is not None
    return ModernBertConfig(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        hidden_activation="gelu", max_position_embeddings=ENCODER_MAX_POSITIONS, global_attn_every_n_layers=3,
        local_attention=MODERNBERT_LOCAL_ATTENTION, **MODERNBERT_ROPE_THETAS, norm_eps=1e-5, norm_bias=biases,
        attention_bias=biases, mlp_bias=biases, classifier_bias=biases, classifier_pooling="mean",
        classifier_activation="gelu", pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
        initializer_range=INIT_STD)


def make_encoder_config(kind: str, num_labels: int | None):
    from transformers import BertConfig, RobertaConfig, XLMRobertaConfig

    common = dict(vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, hidden_act="gelu", initializer_range=INIT_STD)
    if kind == "modernbert":
        config = _modernbert_config(num_labels)
    elif kind == "bert":  # BERT's 2 token types and epsilon
        config = BertConfig(**common, max_position_embeddings=ENCODER_MAX_POSITIONS, type_vocab_size=2,
                            pad_token_id=0, layer_norm_eps=1e-12)
    else:  # one token type; positions from pad_token_id + 1
        cls = RobertaConfig if kind == "roberta" else XLMRobertaConfig
        config = cls(**common, max_position_embeddings=ENCODER_MAX_POSITIONS + 2, type_vocab_size=1, pad_token_id=1,
                     bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5)
    family = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "modernbert": "ModernBert"}[kind]
    config.architectures = [f"{family}Model" if num_labels is None else f"{family}ForSequenceClassification"]
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def build_encoder(kind: str, dir, num_labels: int | None = None) -> pathlib.Path:
    """A tiny random fp32 encoder of `kind` (ENCODER_KINDS) in `dir`, with its family's tokenizer: transformers'
    `<Family>Model`, or with num_labels its `<Family>ForSequenceClassification` (a random head). Deterministic."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    _quiet_transformers()
    dir = pathlib.Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    config = make_encoder_config(kind, num_labels)
    seed = _ENCODER_SEEDS[kind] + (num_labels or 0)
    torch.manual_seed(seed)
    auto = AutoModel if num_labels is None else AutoModelForSequenceClassification
    model = auto.from_config(config, dtype=torch.float32)
    _randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers' names: LayerNorm.weight, which _randomize_ takes for a plain weight
        for name, p in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=g))
    model.eval().save_pretrained(str(dir))
    tokenizers = {"bert": _bert_tokenizer, "modernbert": _modernbert_tokenizer}
    tokenizers.get(kind, _roberta_tokenizer)().save_pretrained(str(dir))
    return dir


def load_hf_encoder(model_dir):
    """transformers' model for an encoder directory (build_encoder's), fp32, cached per process."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    _quiet_transformers()
    key = str(pathlib.Path(model_dir).resolve())
    if key not in _HF_CACHE:
        config = json.loads((pathlib.Path(key) / "config.json").read_text())
        classifier = config["architectures"][0].endswith("ForSequenceClassification")
        auto = AutoModelForSequenceClassification if classifier else AutoModel
        _HF_CACHE[key] = auto.from_pretrained(key, dtype=torch.float32).eval()
    return _HF_CACHE[key]
