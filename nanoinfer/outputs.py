"""What `LLM.generate` and `LLM.embed` return for each prompt."""
from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (max_tokens)
    num_cached_tokens: int  # prompt tokens whose K/V came from the prefix cache at the last admission


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # [hidden_size]


@dataclass
class EmbeddingRequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
