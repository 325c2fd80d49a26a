"""Vision-language checkpoints (`*ForConditionalGeneration`) run as text models: their language model on its text
family's implementation, read from the checkpoint's names; the vision tower and the projector are not loaded.
Text alone needs nothing more: a text token's multimodal-rope position (Qwen2-VL's sections, Qwen3-VL's and Qwen3.5's
interleaved ones, HunYuan-VL's four-axis "xdrope" sections, PaddleOCR-VL's sections, ERNIE 4.5 VL's height/width
frequencies, permuted and then interleaved back) is the same on all axes, which is the 1-D rope
(tests/test_vlm_text.py checks it against transformers' mrope), and Gemma 3's bidirectional attention spans image tokens
only, so text is causal; ERNIE 4.5 VL routes text tokens to its text experts alone (ernie4_5_moe.py)."""
import re
from collections.abc import Iterable
from functools import cache

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata

# Where the checkpoints keep the language model. The Hub's Gemma 3, Mistral 3, Llava(-NeXT, -OneVision), InternVL,
# Aya Vision and Llama 4 files (and what transformers 5's save_pretrained writes for them): `language_model.model.*` and
# `language_model.lm_head`; Qwen2-VL/2.5-VL's: `model.*` and `lm_head` already; Qwen3-VL/3-VL-MoE/3.5's:
# `model.language_model.*` and `lm_head`; Idefics3's and SmolVLM's: `model.text_model.*` and `lm_head`; Emu3's:
# `text_model.model.*` and `text_model.lm_head`; Ovis2.5's: `llm.model.*` and `llm.lm_head`; Nemotron 3 Nano Omni's:
# `language_model.backbone.*` and `language_model.lm_head`; the Qwen Omni thinkers': `model.*` and `lm_head` as saved,
# `thinker.model.*` and `thinker.lm_head` as the whole Omni model's files name them (transformers' thinker reads both).
LANGUAGE_MODEL_NAMES = {"^model.language_model.": "model.", "^language_model.model.": "model.",
                        "^language_model.lm_head.": "lm_head.", "^model.text_model.": "model.",
                        "^text_model.model.": "model.", "^text_model.lm_head.": "lm_head.", "^llm.model.": "model.",
                        "^llm.lm_head.": "lm_head.", "^language_model.backbone.": "model.",
                        "^thinker.model.": "model.", "^thinker.lm_head.": "lm_head."}
# The image side, in the same layouts (transformers' own in-memory names too): Llava-NeXT's and OneVision's
# `image_newline`, Idefics3's and SmolVLM's `vision_model` and `connector`, Llama 4's `vision_model` at the top, Gemma
# 4's audio tower and the projections of both towers into the text (`embed_vision`, `embed_audio`; Gemma 4 unified's
# patch embedder, which its files name `vision_embedder`), Emu3's image tokenizer (`vqmodel`), Inkling's audio
# embeddings in its Hub layout (`model.audio`); dots3 note's Hub layout (the language model at `model.*`):
# `vision_encoder`, `audio_encoder` (its adapter within, or `audio_adapter` beside it); MiniMax-M3's `patch_merge_mlp`;
# Video-LLaVA's `image_tower` and `video_tower`; DeepSeek-VL's `aligner`; LightOnOCR's `vision_encoder` and
# `vision_projection`; Ovis2's `visual_embeddings_table`; MiniCPM-V's `merger`; HyperCLOVA X Vision's
# `vision_projector`; Granite Vision 4's deepstack and spatial Q-Former projectors; HunyuanOCR's `vit` (its tower and
# projector, at the top or, as transformers' conversion also reads, under `model.`); Molmo 2's Hub layout's
# `model.vision_backbone` (its ViT, pooling and projector); PaddleOCR-VL's projector (`mlp_AR`); ERNIE 4.5 VL's
# resampler (`model.resampler_model`); Janus's image-generation embeddings, aligner and head (`model.generation_*`);
# DeepSeek-VL hybrid's high-resolution tower, neck, projection and alpha (`model.high_res_vision_*`); VideoLLaMA3's and
# Cosmos3 Edge's `model.projector`; Qianfan-OCR's `mlp1` (its projector in the Hub's layout); Ovis2.5's Hub layout's
# `visual_tokenizer` and `vte` (its tower and projector, its visual embedding table); Fuyu's patch embedding
# `vision_embed_tokens`; Kimi-K2.5's `mm_projector` (the Hub's at the top, its pre-norm under `model.` as transformers
# saves it); Granite Docling's `model.density_router`; Apertus 1.5's image and audio tokenizers
# (`model.vision_tokenizer`, `model.audio_tokenizer`); DeepSeek-OCR 2's Hub layout's SAM and Qwen2 encoders
# (`model.sam_model`, `model.qwen2_model`), `model.projector` and `model.view_seperator` (transformers' in-memory
# `model.view_separator`); Muse Glimmer's `model.vision_adapter` (before `model.vision_projection`); Step 3.7's Hub
# layout's `vit_large_projector` (its `vision_model` at the top too); the Qwen Omni thinkers' `audio_tower` (and, in the
# whole Omni model's files, `thinker.visual`, `thinker.audio_tower` and the speech side: `talker`, `token2wav`,
# `code2wav`); Nemotron 3 Nano Omni's Hub layout: its projectors `mlp1`, `sound_projection` and `vision_projector` (the
# vision tower's final norm there; transformers' names: `multi_modal_projector`, `embed_audio`,
# `vision_final_layernorm`), its `sound_encoder` (`audio_tower`), and its language model's MTP layers
# (`language_model.mtp`), which transformers skips too; Kosmos-2.5's `image_to_text_projection` (its `vision_model` at
# the top, its language model at `text_model.model.*`).
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.", "image_newline", "vision_model.", "vqmodel.",
                   "vision_encoder.", "audio_encoder.", "audio_adapter.", "patch_merge_mlp.", "image_tower.",
                   "video_tower.", "model.vision_tower.", "model.multi_modal_projector.", "model.visual.",
                   "model.image_newline", "model.vision_model.", "model.connector.", "model.audio_tower.",
                   "model.embed_vision.", "model.embed_audio.", "model.vision_embedder.", "model.vqmodel.",
                   "model.audio.", "model.image_tower.", "model.video_tower.", "model.aligner.",
                   "model.vision_encoder.", "model.vision_projection.", "model.visual_embeddings_table.",
                   "model.merger.", "model.vision_projector.", "model.layerwise_projectors.",
                   "model.spatial_projectors.", "vit.", "model.vit.", "model.vision_backbone.", "mlp_AR.",
                   "model.resampler_model.", "model.generation_", "model.high_res_vision_", "model.projector.",
                   "mlp1.", "visual_tokenizer.", "vte.", "vision_embed_tokens.", "model.vision_embed_tokens.",
                   "mm_projector.", "model.mm_projector.", "model.density_router.", "model.vision_tokenizer.",
                   "model.audio_tokenizer.", "model.sam_model.", "model.qwen2_model.", "model.view_seperator",
                   "model.view_separator", "model.vision_adapter.", "vit_large_projector.", "audio_tower.",
                   "thinker.visual.", "thinker.audio_tower.", "talker.", "token2wav.", "code2wav.",
                   "sound_projection.", "vision_projector.", "sound_encoder.", "embed_audio.",
                   "vision_final_layernorm.", "language_model.mtp.", "image_to_text_projection.")

# Cosmos3's checkpoints (Edge's and Omni's; transformers' save_pretrained writes them so too) keep the language model
# at the top (`layers.*`, `embed_tokens`, `norm`, `lm_head`, or under `model.language_model.`), newer ones with
# Diffusers' attention names, and Omni's vision tower at the top as well; its unified ones also hold the generator (a
# second expert, `*moe_gen*`, and cross-modal projections in every layer) and the sound and action towers, which
# transformers drops by these patterns.
COSMOS3 = ("Cosmos3EdgeForConditionalGeneration", "Cosmos3OmniForConditionalGeneration")
WRAPPER_WEIGHT_NAMES = dict.fromkeys(COSMOS3, {
    "^layers.": "model.layers.", "^embed_tokens.": "model.embed_tokens.", "^norm.": "model.norm.",
    ".self_attn.to_q.": ".self_attn.q_proj.", ".self_attn.to_k.": ".self_attn.k_proj.",
    ".self_attn.to_v.": ".self_attn.v_proj.", ".self_attn.to_out.": ".self_attn.o_proj.",
    ".self_attn.norm_q.": ".self_attn.q_norm.", ".self_attn.norm_k.": ".self_attn.k_norm."})
WRAPPER_DROPPED_WEIGHTS = dict.fromkeys(COSMOS3, re.compile(
    r"^(blocks|merger|patch_embed|pos_embed|deepstack_merger_list)\.|\.add_[qkv]_proj\.|\.to_add_out\.|"
    r"\.norm_added_[qk]\.|\.k_norm_und_for_gen\.|moe_gen|"
    r"^(model\.language_model\.)?((audio_|action_)?proj_(in|out)|time_embedder)\.|"
    r"^(model\.language_model\.)?(audio|action)_modality_embed$"))

# Wrappers whose logits are the text family's own (logit scale included), beside the families that say so themselves
# (`wrapper_scales_logits`): Aya Vision's multiplies by its Cohere 2 text model's logit_scale, as vLLM's and
# transformers 5.25's do (5.23's dropped it); HyperCLOVA X Vision V2's, Granite Vision 4's and Granite Docling's by
# their text model's logits_scaling; Apertus 1.5's are its text model's (a pruned head's, -inf past it).
WRAPPERS_SCALING_LOGITS = {"AyaVisionForConditionalGeneration", "HyperCLOVAXVisionV2ForConditionalGeneration",
                           "Granite4VisionForConditionalGeneration", "GraniteDoclingForConditionalGeneration",
                           "Apertus1p5ForConditionalGeneration"}

# The outer config's placeholder ids, copied to the language model's config: Gemma 4's wrapper embeds them as the pad
# token when no media come with them (see gemma4.py); those of MEDIA_TOKEN_STAND_INS as another id.
MEDIA_TOKEN_IDS = ("image_token_id", "video_token_id", "audio_token_id")
# Wrappers that embed the placeholder ids as another id where no media come with them: Kimi-K2.5's, Muse Glimmer's and
# Muse Spark's as id 0 (Kimi-K2.5's video placeholder, 163840, is past its vocabulary).
MEDIA_TOKEN_STAND_INS = dict.fromkeys(("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration",
                                       "MuseGlimmerForConditionalGeneration", "MuseSparkForConditionalGeneration"), 0)


@cache
def text_only(causal_lm: type[nn.Module], architecture: str) -> type[nn.Module]:
    """causal_lm (the language model's family) reading a vision-language checkpoint of `architecture`: the family's
    own checkpoint names apply after the language model's prefix is taken off."""

    def __init__(self, config: PretrainedConfig) -> None:
        causal_lm.__init__(self, config)
        if architecture in MEDIA_TOKEN_STAND_INS:  # the placeholder ids that forward embeds as the stand-in
            self.placeholder_ids = [getattr(config, name) for name in MEDIA_TOKEN_IDS
                                    if getattr(config, name, None) is not None]
        # Instance attributes: some families set theirs per config (DeepSeek-V3's and GLM-4.5's MTP layers).
        self.weight_name_substitutions = {**LANGUAGE_MODEL_NAMES, **WRAPPER_WEIGHT_NAMES.get(architecture, {}),
                                          **getattr(self, "weight_name_substitutions", {})}
        # Less what the language model loads itself (Gemma 3n's embeddings of media token ids).
        own = [name for name, _ in self.named_parameters()]
        # The family's own skipped weights (GLM-OCR's MTP layer) also as the wrapper's layouts name them: skipping
        # reads the checkpoint's names.
        family = tuple(getattr(self, "ignored_weight_prefixes", ()))
        self.ignored_weight_prefixes = tuple(p for p in VISION_PREFIXES if not any(n.startswith(p) for n in own)) + \
            family + tuple(old[1:] + p[len(new):] for p in family for old, new in LANGUAGE_MODEL_NAMES.items()
                           if p.startswith(new))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The bare LM head: transformers' wrappers apply none of the text family's logit scaling (Gemma 2/3's final
        softcapping, Cohere's logit_scale, Granite's logits_scaling), except where the family says they do."""
        return self.lm_head(hidden_states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        for token_id in self.placeholder_ids:
            input_ids = input_ids.masked_fill(input_ids == token_id, MEDIA_TOKEN_STAND_INS[architecture])
        return causal_lm.forward(self, input_ids, positions, meta)

    def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The wrapper's dropped weights left out, then the family's own conversion, if it has one."""
        dropped = WRAPPER_DROPPED_WEIGHTS[architecture]
        kept = ((name, tensor) for name, tensor in weights if not dropped.search(name))
        own = getattr(causal_lm, "convert_checkpoint", None)
        return kept if own is None else own(kept)

    namespace = {"__init__": __init__, "__doc__": causal_lm.__doc__}
    if architecture in MEDIA_TOKEN_STAND_INS:
        namespace["forward"] = forward
    if architecture in WRAPPER_DROPPED_WEIGHTS:
        namespace["convert_checkpoint"] = staticmethod(convert_checkpoint)
    if not getattr(causal_lm, "wrapper_scales_logits", False) and architecture not in WRAPPERS_SCALING_LOGITS:
        namespace["compute_logits"] = compute_logits
    return type(architecture, (causal_lm,), namespace)
