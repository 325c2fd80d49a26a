"""What generation returns, shaped like vLLM's (a RequestOutput per prompt holding n CompletionOutputs),
and what `LLM.embed`, `LLM.classify` and `LLM.score` return."""
from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 for the most likely token
    decoded_token: str | None = None


# One dict per position: the chosen token and the top-k alternatives, by token id.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt token has none


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs, when logprobs were asked for
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" (EOS, stop token or string), "length" (max_tokens), "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS and length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # over all n completions

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None for a prompt given as embeddings
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prompt tokens whose K/V came from the prefix cache (completion 0)


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # [hidden_size]


@dataclass
class EmbeddingRequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # [num_labels]: the activation's output (see LLM.classify), or the logits without it


@dataclass
class ClassificationRequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]  # the pair's, as the model read it
    outputs: ScoringOutput
