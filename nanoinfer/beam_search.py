"""Beam search as vLLM's `LLM.beam_search` runs it: a loop over the engine that, each step, runs every live beam for
one token with its top 2 * beam_width logprobs (the prefix cache makes the beams' shared prefixes cheap)."""
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import Logprob, RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams, _check_int, _check_number

# Runs one token for each beam (given as its token ids, with its prompt's adapter): one finished RequestOutput per
# beam, in order.
Expand = Callable[[list[list[int]], list[LoRARequest | None]], list[RequestOutput]]


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int  # completion tokens per beam
    ignore_eos: bool = False  # EOS is then a token like any other: its beams go on
    # Picks the token each beam's one-token request samples, a candidate beside the top 2 * beam_width (as in vLLM).
    temperature: float = 0.0
    length_penalty: float = 1.0  # beams are ranked by cum_logprob / length ** length_penalty

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """TypeError/ValueError naming the field; run again by LLM.beam_search (fields may have changed)."""
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            _check_int(name, value)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_number("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        _check_number("length_penalty", self.length_penalty)
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")

    def step_params(self) -> SamplingParams:
        """One token per beam with its 2 * beam_width best candidates: as transformers keeps 2 * num_beams, so that
        beam_width beams stay alive when candidates end in EOS."""
        return SamplingParams(temperature=self.temperature, max_tokens=1, logprobs=2 * self.beam_width,
                              output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + completion
    logprobs: list[dict[int, Logprob]]  # per completion token: every candidate of that step, the chosen one included
    cum_logprob: float = 0.0
    text: str | None = None  # the decoded tokens, prompt included (vLLM's); None without a tokenizer
    finish_reason: str | None = None  # "stop" (ends in EOS) or "length" (max_tokens)
    stop_reason: int | str | None = None  # None for EOS, as in generate's outputs


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best beam_width, best first


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_ids: Collection[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's rank of a beam: the length counts the prompt and the completion but not a final EOS (transformers'
    counts the completion only, EOS included)."""
    length = len(tokens) - (tokens[-1] in eos_token_ids)
    return cumulative_logprob / length ** length_penalty


def check_beam_search(prompts: list[list[int]], params: BeamSearchParams, vocab_size: int, max_model_len: int,
                      concurrency_limit: int | None) -> None:
    """What the engine would refuse midway, refused before the first step."""
    if 2 * params.beam_width > vocab_size:
        raise ValueError(f"beam_width={params.beam_width}: 2 * beam_width candidates exceed the vocabulary size "
                         f"{vocab_size}")
    too_long = next((len(p) for p in prompts if len(p) + params.max_tokens > max_model_len), None)
    if too_long is not None:
        raise ValueError(f"prompt of {too_long} tokens + max_tokens={params.max_tokens} exceeds "
                         f"max_model_len={max_model_len}")
    if concurrency_limit is not None:
        _check_int("concurrency_limit", concurrency_limit)
        if concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be None or >= 1, got {concurrency_limit}")


@dataclass
class _Instance:
    """One prompt's search: its live beams and those that ended in EOS."""
    beams: list[BeamSearchSequence]
    lora_request: LoRARequest | None  # every beam of the prompt runs with it
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(prompts: list[list[int]], lora_requests: list[LoRARequest | None], params: BeamSearchParams,
                eos_token_ids: Collection[int], expand: Expand, decode: Callable[[list[int]], str] | None,
                use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """One BeamSearchOutput per prompt, in order, each prompt's beams run with its adapter (or None); at most
    concurrency_limit prompts' beams run at a time."""
    assert len(lora_requests) == len(prompts)
    limit = concurrency_limit or len(prompts)
    outputs = []
    for start in range(0, len(prompts), limit):
        instances = [_Instance([BeamSearchSequence(list(p), [])], lora)
                     for p, lora in zip(prompts[start:start + limit], lora_requests[start:start + limit])]
        _search(instances, params, eos_token_ids, expand, use_tqdm)
        outputs += [_best(instance, params, eos_token_ids, decode) for instance in instances]
    return outputs


def _search(instances: list[_Instance], params: BeamSearchParams, eos_token_ids: Collection[int], expand: Expand,
            use_tqdm: bool) -> None:
    stop = frozenset() if params.ignore_eos else eos_token_ids
    # The bar counts steps, an upper bound: a search ends early when every beam has ended in EOS.
    for _ in tqdm(range(params.max_tokens), desc="Beam search", unit="step", disable=not use_tqdm):
        live = [instance for instance in instances if instance.beams]
        if not live:
            break
        results = iter(expand([beam.tokens for instance in live for beam in instance.beams],
                              [instance.lora_request for instance in live for _ in instance.beams]))
        for instance in live:
            candidates = [child for beam in instance.beams for child in _children(beam, next(results))]
            instance.completed += [c for c in candidates if c.tokens[-1] in stop]
            running = [c for c in candidates if c.tokens[-1] not in stop]
            running.sort(key=_score_key(eos_token_ids, params.length_penalty), reverse=True)
            instance.beams = running[:params.beam_width]


def _children(beam: BeamSearchSequence, result: RequestOutput) -> list[BeamSearchSequence]:
    """The beam extended by each candidate of its step: the sampled token and the top 2 * beam_width."""
    step = result.outputs[0].logprobs[0]
    return [BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step], beam.cum_logprob + lp.logprob)
            for token, lp in step.items()]


def _best(instance: _Instance, params: BeamSearchParams, eos_token_ids: Collection[int],
          decode: Callable[[list[int]], str] | None) -> BeamSearchOutput:
    for beam in instance.completed:
        beam.finish_reason = "stop"
    for beam in instance.beams:  # still live after max_tokens steps
        beam.finish_reason = "length"
    best = sorted(instance.completed + instance.beams, key=_score_key(eos_token_ids, params.length_penalty),
                  reverse=True)[:params.beam_width]
    for beam in best:
        beam.text = decode(beam.tokens) if decode is not None else None
    return BeamSearchOutput(best)


def _score_key(eos_token_ids: Collection[int], length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_ids, length_penalty)
