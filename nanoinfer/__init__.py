"""nanoinfer: a compact offline LLM inference engine with a paged KV cache and continuous batching."""
from nanoinfer.beam_search import BeamSearchParams
from nanoinfer.llm import LLM
from nanoinfer.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams
from nanoinfer.structured import GuidedDecodingParams, StructuredOutputsParams
from nanoinfer.utils.log import configure_logging

configure_logging()

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "Logprob",
           "RequestOutput", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams"]
