"""Maps `config.architectures[0]` to the model class that implements it, importing it only when asked."""
import importlib
from functools import cache

from torch import nn
from transformers import PretrainedConfig

_MODELS = {
    "AfmoeForCausalLM": ("afmoe", "AfmoeForCausalLM"),
    "ApertusForCausalLM": ("apertus", "ApertusForCausalLM"),
    "AriaTextForCausalLM": ("aria", "AriaTextForCausalLM"),
    "ArceeForCausalLM": ("arcee", "ArceeForCausalLM"),
    "AXK1ForCausalLM": ("axk1", "AXK1ForCausalLM"),
    "AXK2ForCausalLM": ("axk2", "AXK2ForCausalLM"),
    "BeamForCausalLM": ("beam", "BeamForCausalLM"),
    "BioGptForCausalLM": ("biogpt", "BioGptForCausalLM"),
    # BERT-style models as decoders (is_decoder): post-LN or pre-LN layers, absolute positions, a prediction head.
    "BertLMHeadModel": ("bert_decoder", "BertLMHeadModel"),
    "BertGenerationDecoder": ("bert_decoder", "BertGenerationDecoder"),
    "BigBirdForCausalLM": ("bert_decoder", "BigBirdForCausalLM"),
    "CamembertForCausalLM": ("bert_decoder", "RobertaForCausalLM"),
    "Data2VecTextForCausalLM": ("bert_decoder", "Data2VecTextForCausalLM"),
    "ElectraForCausalLM": ("bert_decoder", "ElectraForCausalLM"),
    "ErnieForCausalLM": ("bert_decoder", "ErnieForCausalLM"),
    "MegatronBertForCausalLM": ("bert_decoder", "MegatronBertForCausalLM"),
    "RemBertForCausalLM": ("bert_decoder", "RemBertForCausalLM"),
    "RobertaForCausalLM": ("bert_decoder", "RobertaForCausalLM"),
    "RoCBertForCausalLM": ("bert_decoder", "RoCBertForCausalLM"),
    "RoFormerForCausalLM": ("bert_decoder", "RoFormerForCausalLM"),
    "RobertaPreLayerNormForCausalLM": ("bert_decoder", "RobertaPreLayerNormForCausalLM"),
    "XLMRobertaForCausalLM": ("bert_decoder", "RobertaForCausalLM"),
    "XLMRobertaXLForCausalLM": ("bert_decoder", "XLMRobertaXLForCausalLM"),
    "XmodForCausalLM": ("bert_decoder", "XmodForCausalLM"),
    "BloomForCausalLM": ("bloom", "BloomForCausalLM"),
    # Its language model inside the wrapper (no ChameleonForCausalLM); the VQ image tokenizer skipped (chameleon.py).
    "ChameleonForConditionalGeneration": ("chameleon", "ChameleonForConditionalGeneration"),
    "CodeGenForCausalLM": ("codegen", "CodeGenForCausalLM"),
    "Cohere2ForCausalLM": ("cohere2", "Cohere2ForCausalLM"),
    "Cohere2MoeForCausalLM": ("cohere2_moe", "Cohere2MoeForCausalLM"),
    "CohereCompassForCausalLM": ("cohere_compass", "CohereCompassForCausalLM"),
    "CohereForCausalLM": ("cohere", "CohereForCausalLM"),
    "CTRLLMHeadModel": ("ctrl", "CTRLLMHeadModel"),
    "CwmForCausalLM": ("llama", "LlamaForCausalLM"),  # Llama's windows by layer_types (Qwen2's attention), no biases
    "DbrxForCausalLM": ("dbrx", "DbrxForCausalLM"),
    "BitNetForCausalLM": ("bitnet", "BitNetForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("deepseek_v32", "DeepseekV32ForCausalLM"),
    "DeepseekV4ForCausalLM": ("deepseek_v4", "DeepseekV4ForCausalLM"),
    "DiffLlamaForCausalLM": ("diffllama", "DiffLlamaForCausalLM"),
    "DogeForCausalLM": ("doge", "DogeForCausalLM"),
    "DoryForCausalLM": ("dory", "DoryForCausalLM"),
    "Dots1ForCausalLM": ("dots1", "Dots1ForCausalLM"),
    "Dots3NoteForCausalLM": ("dots3_note", "Dots3NoteForCausalLM"),
    "Emu3ForCausalLM": ("llama", "LlamaForCausalLM"),  # Emu3's text model: Llama's layers, no biases
    "ErgoForCausalLM": ("ergo", "ErgoForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "Exaone4ForCausalLM": ("exaone4", "Exaone4ForCausalLM"),
    "ExaoneMoeForCausalLM": ("exaone_moe", "ExaoneMoeForCausalLM"),
    "FalconForCausalLM": ("falcon", "FalconForCausalLM"),
    "FlexOlmoForCausalLM": ("olmoe", "FlexOlmoForCausalLM"),
    "FlintForCausalLM": ("flint", "FlintForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3nForCausalLM": ("gemma3n", "Gemma3nForCausalLM"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM"),
    "Gemma4UnifiedForCausalLM": ("gemma4", "Gemma4ForCausalLM"),  # Gemma 4 without per-layer inputs or experts
    "GlmForCausalLM": ("glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
    "GlmMoeDsaForCausalLM": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "GPTBigCodeForCausalLM": ("gpt_bigcode", "GPTBigCodeForCausalLM"),
    "GPTJForCausalLM": ("gptj", "GPTJForCausalLM"),
    "GPTNeoForCausalLM": ("gpt_neo", "GPTNeoForCausalLM"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "GPTNeoXJapaneseForCausalLM": ("gpt_neox_japanese", "GPTNeoXJapaneseForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("granitemoe", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("granitemoe", "GraniteMoeForCausalLM"),
    "GraniteMoeSWAForCausalLM": ("granitemoe", "GraniteMoeSWAForCausalLM"),
    "GraniteSWAForCausalLM": ("granite", "GraniteSWAForCausalLM"),
    "HeliumForCausalLM": ("helium", "HeliumForCausalLM"),
    "HrmTextForCausalLM": ("hrm_text", "HrmTextForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM"),
    "HunYuanMoEV1ForCausalLM": ("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM"),
    "HyperCLOVAXForCausalLM": ("hyperclovax", "HyperCLOVAXForCausalLM"),
    "InklingForCausalLM": ("inkling", "InklingForCausalLM"),
    "Inkling2ForCausalLM": ("inkling2", "Inkling2ForCausalLM"),
    "Inkling2LoopForCausalLM": ("inkling2_loop", "Inkling2LoopForCausalLM"),
    "HYV3ForCausalLM": ("hy_v3", "HYV3ForCausalLM"),
    "HYV4ForCausalLM": ("hy_v4", "HYV4ForCausalLM"),
    "Jais2ForCausalLM": ("jais2", "Jais2ForCausalLM"),
    "JetMoeForCausalLM": ("jetmoe", "JetMoeForCausalLM"),
    "Kolibri1ForCausalLM": ("kolibri1", "Kolibri1ForCausalLM"),
    "Kolibri1_1ForCausalLM": ("kolibri1_1", "Kolibri1_1ForCausalLM"),
    "LagunaForCausalLM": ("laguna", "LagunaForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "LongcatFlashForCausalLM": ("longcat_flash", "LongcatFlashForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "MellumForCausalLM": ("mellum", "MellumForCausalLM"),
    "MiMoV2FlashForCausalLM": ("mimo_v2_flash", "MiMoV2FlashForCausalLM"),
    "MiniCPM3ForCausalLM": ("minicpm3", "MiniCPM3ForCausalLM"),
    "MiniCPM5MoeForCausalLM": ("minicpm5_moe", "MiniCPM5MoeForCausalLM"),
    "Apertus1p5TextForCausalLM": ("apertus1p5", "Apertus1p5TextForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "MiniMaxM3VLForCausalLM": ("minimax_m3", "MiniMaxM3VLForCausalLM"),
    "MinistralForCausalLM": ("llama", "LlamaForCausalLM"),  # Llama's windows by layer_types (Qwen2's attention)
    "Ministral3ForCausalLM": ("ministral3", "Ministral3ForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Mistral4ForCausalLM": ("mistral4", "Mistral4ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "MllamaForCausalLM": ("mllama", "MllamaForCausalLM"),
    "ModernBertDecoderForCausalLM": ("modernbert", "ModernBertDecoderForCausalLM"),
    "MPTForCausalLM": ("mpt", "MptForCausalLM"),  # MosaicML's own remote-code name, as on the Hub
    "MptForCausalLM": ("mpt", "MptForCausalLM"),
    "NanoChatForCausalLM": ("nanochat", "NanoChatForCausalLM"),
    "NemotronForCausalLM": ("nemotron", "NemotronForCausalLM"),
    "OlmoForCausalLM": ("olmo", "OlmoForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo3", "Olmo3ForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "OpenAIGPTLMHeadModel": ("openai_gpt", "OpenAIGPTLMHeadModel"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "PersimmonForCausalLM": ("persimmon", "PersimmonForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Phi4MultimodalForCausalLM": ("phi4_multimodal", "Phi4MultimodalForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "PhimoeForCausalLM": ("phimoe", "PhimoeForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen4ExpForCausalLM": ("qwen4_exp", "Qwen4ExpForCausalLM"),
    "SeedOssForCausalLM": ("seed_oss", "SeedOssForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    # GLM-4.5's model without q/k norms, experts on every layer (the config has neither use_qk_norm nor
    # first_k_dense_replace)
    "SolarOpenForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "StableLmForCausalLM": ("stablelm", "StableLmForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "VaultGemmaForCausalLM": ("vaultgemma", "VaultGemmaForCausalLM"),
    "XGLMForCausalLM": ("xglm", "XGLMForCausalLM"),
    "YoutuForCausalLM": ("youtu", "YoutuForCausalLM"),
}
# The decoders of encoder-decoder models run alone, as transformers' *ForCausalLM (their *ForConditionalGeneration
# checkpoints are not here: generating with them needs the encoder).
_MODELS |= {name: ("seq2seq_decoder", "Seq2SeqDecoderForCausalLM") for name in (
    "BartForCausalLM", "MBartForCausalLM", "MarianForCausalLM", "PegasusForCausalLM", "BlenderbotForCausalLM",
    "BlenderbotSmallForCausalLM", "PLBartForCausalLM", "MvpForCausalLM", "TrOCRForCausalLM",
    "BigBirdPegasusForCausalLM", "WhisperForCausalLM")}
# Hybrids of attention with recurrent layers (Mamba2, short convolutions, linear attention; Zamba's and Zamba2's
# shared attention blocks; ZAYA's attention, whose q/k convs and delayed values keep recurrent state).
_MODELS |= {
    "BailingHybridForCausalLM": ("bailing_hybrid", "BailingHybridForCausalLM"),
    "BambaForCausalLM": ("bamba", "BambaForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "KimiLinearForCausalLM": ("kimi_linear", "KimiLinearForCausalLM"),
    "LaraMiniForCausalLM": ("lara_mini", "LaraMiniForCausalLM"),
    "Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("lfm2", "Lfm2MoeForCausalLM"),
    "Lfm3ForCausalLM": ("lfm3", "Lfm3ForCausalLM"),
    "MiniMaxForCausalLM": ("minimax", "MiniMaxForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "OlmoHybridForCausalLM": ("olmo_hybrid", "OlmoHybridForCausalLM"),
    "RecurrentGemmaForCausalLM": ("recurrent_gemma", "RecurrentGemmaForCausalLM"),
    "ZambaForCausalLM": ("zamba", "ZambaForCausalLM"),
    "Zamba2ForCausalLM": ("zamba2", "Zamba2ForCausalLM"),
    "ZayaForCausalLM": ("zaya", "ZayaForCausalLM"),
}
# State-space models: on the Mamba-1 mixer, alone or with attention; on the Mamba2 mixer alone; xLSTM's mLSTM.
_MODELS |= {
    "FalconMambaForCausalLM": ("falcon_mamba", "FalconMambaForCausalLM"),
    "JambaForCausalLM": ("jamba", "JambaForCausalLM"),
    "MambaForCausalLM": ("mamba", "MambaForCausalLM"),
    "Mamba2ForCausalLM": ("mamba", "Mamba2ForCausalLM"),
    "RwkvForCausalLM": ("rwkv", "RwkvForCausalLM"),  # RWKV-4: token shifts and a WKV state, no attention
    "xLSTMForCausalLM": ("xlstm", "xLSTMForCausalLM"),  # mLSTM blocks: a matrix memory per head, no attention
}

# Sequence classification (see classification.py) over the decoder of the causal LM of the same family.
_CLASSIFIERS = {f"{family}ForSequenceClassification": f"{family}ForCausalLM" for family in (
    "Arcee", "DeepseekV2", "DeepseekV3", "Exaone4", "Falcon", "Gemma", "Gemma2", "Glm", "Glm4", "GPTBigCode", "GPTJ",
    "GPTNeo", "GPTNeoX", "Helium", "HunYuanDenseV1", "HunYuanMoEV1", "Llama", "Mistral", "Mixtral", "Nemotron", "Olmo",
    "Olmo2", "Olmo3", "OPT", "Persimmon", "Phi", "Phi3", "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe", "SeedOss", "SmolLM3",
    "StableLm", "Starcoder2")} | {
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM", "GPT2ForSequenceClassification": "GPT2LMHeadModel",
    "CTRLForSequenceClassification": "CTRLLMHeadModel",
    "OpenAIGPTForSequenceClassification": "OpenAIGPTLMHeadModel"}

# Encoder-only models (bert.py, modernbert.py): bidirectional, with absolute positions or rope; embedders (`*Model`:
# LLM.embed) and classifiers on the first token or the mean (LLM.classify, LLM.score). They never generate.
_ENCODERS = {
    "BertModel": ("bert", "BertModel"),
    "RobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaModel": ("bert", "RobertaModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "ModernBertModel": ("modernbert", "ModernBertModel"),
    "ModernBertForSequenceClassification": ("modernbert", "ModernBertForSequenceClassification"),
}

# Vision-language checkpoints, run as their language model alone (see vision_language.py; config.py gives the model
# the checkpoint's text_config): the class of that language model, by the text config's model_type; _ANY_TEXT_FAMILY
# where transformers' wrapper takes any text model (AutoModel.from_config), i.e. every causal LM here.
_ANY_TEXT_FAMILY = None
_VISION_LANGUAGE = {
    "Apertus1p5ForConditionalGeneration": {"apertus1p5_text": _MODELS["Apertus1p5TextForCausalLM"]},
    "AriaForConditionalGeneration": {"aria_text": _MODELS["AriaTextForCausalLM"]},
    "CohereCompassForConditionalGeneration": {"cohere_compass_text": _MODELS["CohereCompassForCausalLM"]},
    # Cosmos3's reasoners (their checkpoints' layout in vision_language.py).
    "Cosmos3EdgeForConditionalGeneration": {"cosmos3_edge_text": _MODELS["ArceeForCausalLM"]},
    "Cosmos3OmniForConditionalGeneration": {"qwen3_vl_text": _MODELS["Qwen3ForCausalLM"]},
    "DeepseekOcr2ForConditionalGeneration": {"deepseek_ocr2_text": ("deepseek_ocr2", "DeepseekOcr2TextForCausalLM")},
    "Dots3NoteForConditionalGeneration": {"dots3_note_text": _MODELS["Dots3NoteForCausalLM"]},
    "Emu3ForConditionalGeneration": {"emu3_text_model": _MODELS["Emu3ForCausalLM"]},
    "Ernie4_5_VLMoeForConditionalGeneration": {"ernie4_5_vl_moe_text": ("ernie4_5_moe", "Ernie4_5_VLMoeLanguageModel")},
    "Gemma3ForConditionalGeneration": {"gemma3_text": _MODELS["Gemma3ForCausalLM"]},
    "Gemma3nForConditionalGeneration": {"gemma3n_text": _MODELS["Gemma3nForCausalLM"]},
    "Gemma4ForConditionalGeneration": {"gemma4_text": _MODELS["Gemma4ForCausalLM"]},
    "Gemma4UnifiedForConditionalGeneration": {"gemma4_unified_text": _MODELS["Gemma4ForCausalLM"]},
    # GIT's wrapper, named as a causal LM: its flat config is the text decoder's own (git.py).
    "GitForCausalLM": {"git": ("git", "GitForCausalLM")},
    "Glm4vForConditionalGeneration": {"glm4v_text": _MODELS["Glm4ForCausalLM"]},
    "Glm4vMoeForConditionalGeneration": {"glm4v_moe_text": _MODELS["Glm4MoeForCausalLM"]},
    # GLM-4.6V's wrapper (model_type glm46v or glmga): Glm4v's, its language model built from the text config's
    # model_type; the two whose text model reads the wrapper's stacked multimodal positions.
    "Glm46VForConditionalGeneration": {"glm4v_text": _MODELS["Glm4ForCausalLM"],
                                       "glm4v_moe_text": _MODELS["Glm4MoeForCausalLM"]},
    "GlmOcrForConditionalGeneration": {"glm_ocr_text": _MODELS["Glm4ForCausalLM"]},
    "Granite4VisionForConditionalGeneration": {"granite4_vision_text": _MODELS["GraniteForCausalLM"]},
    "GraniteDoclingForConditionalGeneration": {"granite_docling_text": _MODELS["GraniteForCausalLM"]},
    # HunyuanOCR's flat config (no text_config) folds the outer model_type into the text config transformers builds.
    "HunYuanVLForConditionalGeneration": dict.fromkeys(("hunyuan_vl_text", "hunyuan_vl"),
                                                       _MODELS["HunYuanDenseV1ForCausalLM"]),
    "HYV4VLForConditionalGeneration": {"hy_v4_vl_text": ("hy_v4", "HYV4VLTextForCausalLM")},
    "InklingForConditionalGeneration": {"inkling_text": _MODELS["InklingForCausalLM"]},
    "Inkling2ForConditionalGeneration": {"inkling2_text": _MODELS["Inkling2ForCausalLM"]},
    "Inkling2LoopForConditionalGeneration": {"inkling2_loop_text": _MODELS["Inkling2LoopForCausalLM"]},
    # Kimi-K2.5's and K2.6's Hub configs name their remote code's class; transformers' own is Kimi_K25...
    **dict.fromkeys(("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"),
                    {"deepseek_v3": _MODELS["DeepseekV3ForCausalLM"]}),
    "Kosmos2_5ForConditionalGeneration": {"kosmos_2_5_text_model": ("kosmos2_5", "Kosmos2_5TextForCausalLM")},
    "Llama4ForConditionalGeneration": {"llama4_text": _MODELS["Llama4ForCausalLM"]},
    "Mistral3ForConditionalGeneration": {"mistral": _MODELS["MistralForCausalLM"],
                                         "ministral3": _MODELS["Ministral3ForCausalLM"],
                                         "mistral4": _MODELS["Mistral4ForCausalLM"]},
    "MllamaForConditionalGeneration": {"mllama_text_model": _MODELS["MllamaForCausalLM"]},
    "MiniMaxM3SparseForConditionalGeneration": {"minimax_m3_vl_text": _MODELS["MiniMaxM3VLForCausalLM"]},
    "Molmo2ForConditionalGeneration": {"molmo2_text": ("molmo2", "Molmo2TextForCausalLM")},
    "MuseGlimmerForConditionalGeneration": {"muse_glimmer_text": ("muse_glimmer", "MuseGlimmerTextForCausalLM")},
    "MuseSparkForConditionalGeneration": {"muse_spark_text": ("muse_spark", "MuseSparkTextForCausalLM")},
    "NemotronH_Omni_Reasoning_V3": {"nemotron_h": _MODELS["NemotronHForCausalLM"]},  # Nemotron 3 Nano Omni
    "PaddleOCRVLForConditionalGeneration": {"paddleocr_vl_text": ("ernie4_5", "PaddleOCRTextForCausalLM")},
    "Qwen2VLForConditionalGeneration": {"qwen2_vl_text": _MODELS["Qwen2ForCausalLM"]},
    "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": _MODELS["Qwen2ForCausalLM"]},
    # Qwen2.5-Omni's and Qwen3-Omni's thinkers (their audio and vision towers skipped).
    "Qwen2_5OmniThinkerForConditionalGeneration": {"qwen2_5_omni_text": _MODELS["Qwen2ForCausalLM"]},
    "Qwen3OmniMoeThinkerForConditionalGeneration": {"qwen3_omni_moe_text": ("qwen3_moe",
                                                                            "Qwen3OmniMoeThinkerLanguageModel")},
    "Qwen3VLForConditionalGeneration": {"qwen3_vl_text": _MODELS["Qwen3ForCausalLM"]},
    "Qwen3VLMoeForConditionalGeneration": {"qwen3_vl_moe_text": ("qwen3_moe", "Qwen3VLMoeLanguageModel")},
    "Qwen3_5ForConditionalGeneration": {"qwen3_5_text": _MODELS["Qwen3_5ForCausalLM"]},
    "Qwen3_5MoeForConditionalGeneration": {"qwen3_5_moe_text": _MODELS["Qwen3_5MoeForCausalLM"]},
    "Qwen4ExpForConditionalGeneration": {"qwen4_exp_text": _MODELS["Qwen4ExpForCausalLM"]},
    "Step3p7ForConditionalGeneration": {"step3p5": ("step3p5", "Step3p5ForCausalLM")},
} | dict.fromkeys(("AyaVisionForConditionalGeneration", "Cohere2VisionForConditionalGeneration",
                   "DeepseekVLForConditionalGeneration", "DeepseekVLHybridForConditionalGeneration",
                   "Exaone4_5_ForConditionalGeneration", "FastVlmForConditionalGeneration",
                   "FuyuForCausalLM",  # (Fuyu's wrapper, named as a causal LM)
                   "GotOcr2ForConditionalGeneration", "HyperCLOVAXVisionV2ForConditionalGeneration",
                   "Idefics2ForConditionalGeneration", "Idefics3ForConditionalGeneration",
                   "InternVLForConditionalGeneration", "JanusForConditionalGeneration",
                   "Lfm2VlForConditionalGeneration", "Lfm3VlForConditionalGeneration",
                   "LightOnOcrForConditionalGeneration", "LlavaForConditionalGeneration",
                   "LlavaNextForConditionalGeneration", "LlavaNextVideoForConditionalGeneration",
                   "LlavaOnevisionForConditionalGeneration", "LlavaOnevision15ForConditionalGeneration",
                   "MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration",
                   "MiniCPMOcrForConditionalGeneration", "Ovis2ForConditionalGeneration",
                   "Ovis2_5ForConditionalGeneration", "PerceptionLMForConditionalGeneration",
                   "QianfanOCRForConditionalGeneration", "SmolVLMForConditionalGeneration",
                   "VideoLlama3ForConditionalGeneration", "VideoLlavaForConditionalGeneration",
                   "VipLlavaForConditionalGeneration"), _ANY_TEXT_FAMILY)


# Families whose attention adds a learned logit per head to every softmax (attention sinks), which flash-attn 2 lacks:
# the attention backend is chosen with them in mind (selector.select_backend).
_ATTENTION_SINKS = {"FlintForCausalLM", "GptOssForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM",
                    "MiMoV2FlashForCausalLM"}
# Families whose attention only the PyTorch backend runs, with what it is: DeepSeek sparse attention (deepseek_v32.py;
# dots3 note's indexed layers, HY-V4's and HY-V4-VL's), DeepSeek-V4's compressed attention (deepseek_v4.py),
# MiniMax-M3's block-sparse attention (minimax_m3.py), Qwen4-Exp's QSA (qwen4_exp.py), Kolibri 1.1's indexed attention
# (kolibri1_1.py), Inkling's, Inkling-2's and Inkling-2-Loop's relative logits (inkling.py, inkling2.py,
# inkling2_loop.py).
_DSA = ("DeepSeek sparse attention", "each query attends to the keys its indexer selects")
_BLOCK_SPARSE = ("block-sparse attention", "each KV head's queries attend to the key blocks its indexer selects")
_QSA = ("QSA", "each query attends to the key blocks its indexer selects and to the tokens after the last whole block")
_INDEXED = ("indexed attention", "each query attends to the NVFP4-rounded keys its indexer selects")
_RELATIVE_LOGITS = ("relative logits", "a bias per query and backward distance, mixed from the query's own state")
_COMPRESSED = ("compressed attention", "each query attends to its window and to pooled entries of earlier windows "
               "(on CSA layers those its indexer selects)")
_PYTORCH_ONLY_ATTENTION = {
    "AXK2ForCausalLM": _DSA, "DeepseekV32ForCausalLM": _DSA, "DeepseekV4ForCausalLM": _COMPRESSED,
    "Dots3NoteForCausalLM": _DSA,
    "Dots3NoteForConditionalGeneration": _DSA, "GlmMoeDsaForCausalLM": _DSA, "HYV4ForCausalLM": _DSA,
    "HYV4VLForConditionalGeneration": _DSA,
    "Kolibri1_1ForCausalLM": _INDEXED,
    "MiniMaxM3VLForCausalLM": _BLOCK_SPARSE, "MiniMaxM3SparseForConditionalGeneration": _BLOCK_SPARSE,
    "Qwen4ExpForCausalLM": _QSA, "Qwen4ExpForConditionalGeneration": _QSA,
    **dict.fromkeys(("InklingForCausalLM", "InklingForConditionalGeneration", "Inkling2ForCausalLM",
                     "Inkling2ForConditionalGeneration", "Inkling2LoopForCausalLM",
                     "Inkling2LoopForConditionalGeneration"), _RELATIVE_LOGITS)}
# Families whose KV cache holds heads wider than their config's head_dim, by this factor (DiffLlama's differential
# attention runs over doubled heads: models/diffllama.py): the backend is chosen and checked for the cache's.
_CACHE_HEAD_MULTIPLES = {"DiffLlamaForCausalLM": 2}  # differential attention: paired value heads side by side
_CACHE_HEAD_PADS = {"DogeForCausalLM": 8}  # Doge's key bias as key entries (models/doge.py, KEY_BIAS_PAD)



def supported_architectures() -> list[str]:
    return sorted(_MODELS.keys() | _CLASSIFIERS.keys() | _ENCODERS.keys() | _VISION_LANGUAGE.keys())


def is_vision_language(architectures: list[str] | None) -> bool:
    return bool(architectures) and architectures[0] in _VISION_LANGUAGE


def is_classifier(architectures: list[str] | None) -> bool:
    return bool(architectures) and (architectures[0] in _CLASSIFIERS or (
        architectures[0] in _ENCODERS and architectures[0].endswith("ForSequenceClassification")))


def is_encoder(architectures: list[str] | None) -> bool:
    return bool(architectures) and architectures[0] in _ENCODERS


def has_attention_sinks(architectures: list[str] | None) -> bool:
    return bool(architectures) and architectures[0] in _ATTENTION_SINKS


def chunked_attention_size(config: PretrainedConfig, layer_idx: int | None = None) -> int | None:
    """Llama 4's chunked local attention: `attention_chunk_size` on the layers `layer_types` marks
    "chunked_attention" (transformers' rule; its default marks the rope layers), on layer_idx or, None, on any."""
    chunked = [t == "chunked_attention" for t in getattr(config, "layer_types", None) or ()]
    if not (any(chunked) if layer_idx is None else layer_idx < len(chunked) and chunked[layer_idx]):
        return None
    return getattr(config, "attention_chunk_size", None)


def pytorch_only_attention(architectures: list[str] | None) -> tuple[str, str, str] | None:
    """(architecture, its attention's name, what it does) where only the PyTorch backend runs that attention, else
    None."""
    if not architectures or architectures[0] not in _PYTORCH_ONLY_ATTENTION:
        return None
    return (architectures[0], *_PYTORCH_ONLY_ATTENTION[architectures[0]])


def cache_head_size(architectures: list[str] | None, head_dim: int) -> int:
    """The head size of the KV cache of a model whose attention heads are head_dim wide."""
    arch = architectures[0] if architectures else None
    return head_dim * _CACHE_HEAD_MULTIPLES.get(arch, 1) + _CACHE_HEAD_PADS.get(arch, 0)


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The class for config.architectures; for a vision-language checkpoint config is its text_config (with the
    checkpoint's architectures), whose model_type names the language model."""
    architectures = config.architectures
    for arch in architectures or []:
        if arch in _VISION_LANGUAGE:
            return _language_model_class(arch, config.model_type)
        if arch in _CLASSIFIERS:
            from nanoinfer.models.classification import sequence_classifier
            return sequence_classifier(_import(_MODELS[_CLASSIFIERS[arch]]))
        if arch in _MODELS:
            return _import(_MODELS[arch])
        if arch in _ENCODERS:
            return _import(_ENCODERS[arch])
    raise ValueError(f"unsupported model architecture {architectures}; supported: {supported_architectures()}")


def _language_model_class(architecture: str, text_model_type: str) -> type[nn.Module]:
    language_models = _VISION_LANGUAGE[architecture]
    if language_models is _ANY_TEXT_FAMILY:
        language_models = _causal_lms_by_model_type()
    if text_model_type not in language_models:
        raise ValueError(f"{architecture} with a {text_model_type!r} language model (text_config.model_type) is not "
                         f"supported; supported: {sorted(language_models)}")
    from nanoinfer.models.vision_language import text_only
    return text_only(_import(language_models[text_model_type]), architecture)


@cache
def _causal_lms_by_model_type() -> dict[str, tuple[str, str]]:
    """The causal LMs here by their config's model_type, as transformers' own table names them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {model_type: _MODELS[name] for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
            if name in _MODELS}


def _import(entry: tuple[str, str]) -> type[nn.Module]:
    module, name = entry
    return getattr(importlib.import_module(f"nanoinfer.models.{module}"), name)
