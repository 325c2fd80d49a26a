"""nanoinfer: a compact offline LLM inference engine with a paged KV cache and continuous batching."""
from nanoinfer.llm import LLM
from nanoinfer.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from nanoinfer.sampling_params import SamplingParams

__all__ = ["LLM", "EmbeddingOutput", "EmbeddingRequestOutput", "RequestOutput", "SamplingParams"]
