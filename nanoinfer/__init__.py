"""nanoinfer: a compact offline LLM inference engine with a paged KV cache and continuous batching."""
from nanoinfer.llm import LLM
from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
