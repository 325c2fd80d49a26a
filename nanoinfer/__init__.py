"""nanoinfer: a compact offline LLM inference engine with a paged KV cache and continuous batching."""
from nanoinfer.beam_search import BeamSearchParams
from nanoinfer.llm import LLM
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                               EmbeddingRequestOutput, Logprob, RequestOutput, ScoringOutput, ScoringRequestOutput)
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams
from nanoinfer.structured import GuidedDecodingParams, StructuredOutputsParams
from nanoinfer.utils.log import configure_logging

configure_logging()

__all__ = ["LLM", "BeamSearchParams", "ClassificationOutput", "ClassificationRequestOutput", "CompletionOutput",
           "EmbeddingOutput", "EmbeddingRequestOutput", "GuidedDecodingParams", "Logprob", "LoRARequest",
           "RequestOutput", "RequestOutputKind", "SamplingParams", "ScoringOutput", "ScoringRequestOutput",
           "StructuredOutputsParams"]
