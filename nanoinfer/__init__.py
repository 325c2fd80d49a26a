"""nanoinfer: a compact offline LLM inference engine with a paged KV cache and continuous batching."""
from nanoinfer.llm import LLM
from nanoinfer.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "Logprob", "RequestOutput",
           "RequestOutputKind", "SamplingParams"]
