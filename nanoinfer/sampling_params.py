"""User-facing sampling options of one request (vLLM's names and meanings), validated on construction and again
when a request enters the engine (fields may have been changed since)."""
import math
from dataclasses import dataclass, field
from enum import Enum

from transformers import PreTrainedTokenizerBase

from nanoinfer.structured.params import StructuredOutputsParams


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every output of a request holds everything generated so far
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top logprobs per generated token, beside the chosen one's; -1: the whole vocabulary
    prompt_logprobs: int | None = None  # the same per prompt token; -1: the whole vocabulary
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (no text, no decoded_token in logprobs), as vLLM's option
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits
    allowed_token_ids: list[int] | None = None  # every other token is masked
    bad_words: list[str] | None = None  # see bad_words_token_ids
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: its last max_model_len
    structured_outputs: StructuredOutputsParams | None = None  # the output must match a regex, JSON schema, ...
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name for structured_outputs
    extra_args: dict | None = None  # options for custom logits processors (see nanoinfer/logits_processor.py)
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)  # `stop` as a list

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (TypeError/ValueError naming it) and refresh the normalized ones (`stop_strings`,
        `stop_token_ids` as a list): what every entry point runs on each request's params."""
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        _check_number("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:  # 0 and -1 both disable it, as in vLLM (whose default is 0)
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            check_seed("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.stop_strings = _as_list("stop", self.stop, str, single_ok=True)
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")
        if self.stop_strings and not self.detokenize:
            raise ValueError(f"stop={self.stop!r} needs the text: stop strings need detokenize=True (stop_token_ids "
                             "work without it)")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, int, single_ok=False)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < -1:
                    raise ValueError(f"{name} must be None, >= 0, or -1 (the whole vocabulary), got {value}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self._validate_token_constraints()
        self._validate_structured_outputs()
        if not isinstance(self.extra_args, dict | None):
            raise TypeError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")

    def _validate_token_constraints(self) -> None:
        """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens: what can be checked without the model
        (the engine checks token ids against its vocabulary)."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                _check_token_id("logit_bias", token)
                _check_number(f"logit_bias[{token}]", bias)
                if not math.isfinite(bias):
                    raise ValueError(f"logit_bias[{token}] must be finite, got {bias}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids, int, single_ok=False)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            for token in self.allowed_token_ids:
                _check_token_id("allowed_token_ids", token)
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(_as_list("bad_words", self.bad_words, str, single_ok=False)))
            if any(not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must not hold empty or blank strings, got {self.bad_words!r}")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 (max_model_len), got "
                                 f"{self.truncate_prompt_tokens}")

    def _validate_structured_outputs(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs not in (None, self.guided_decoding):
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            self.structured_outputs = self.guided_decoding
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError(f"structured_outputs must be StructuredOutputsParams, got "
                                f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def bad_words_token_ids(bad_words: list[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word as it stands (left-stripped), and once more after a space when
    that gives a different first token in as many tokens (the word inside a text, for tokenizers that fold the
    space into the token), without special tokens."""
    out = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entry {word!r} encodes to no tokens")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def check_seed(name: str, value: object) -> None:
    _check_int(name, value)
    if not -2**63 <= value < 2**64:  # what torch.Generator.manual_seed accepts
        raise ValueError(f"{name} must fit in 64 bits, got {value}")


def _as_list(name: str, value: object, kind: type, single_ok: bool) -> list:
    if value is None:
        return []
    if single_ok and isinstance(value, kind):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {kind.__name__}s, got {type(value).__name__}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, kind):
            raise TypeError(f"{name} entries must be {kind.__name__}s, got {item!r}")
    return list(value)


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")


def _check_token_id(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} token ids must be ints, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} token ids must be >= 0, got {value}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
