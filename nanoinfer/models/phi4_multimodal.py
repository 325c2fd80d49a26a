"""Phi-4-multimodal (`Phi4MultimodalForCausalLM`) on text alone: Phi-3's decoder (phi3.py). Its image and audio
towers (`model.embed_tokens_extend.*`) only replace the embeddings of image and audio tokens, so they are not loaded;
its vision and speech LoRA adapters ship apart from the model (PEFT subfolders) and apply only with such inputs."""
from nanoinfer.models.phi3 import Phi3ForCausalLM


class Phi4MultimodalForCausalLM(Phi3ForCausalLM):
    ignored_weight_prefixes = ("model.embed_tokens_extend.",)
