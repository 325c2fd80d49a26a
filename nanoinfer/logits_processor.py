"""Custom logits processors, vLLM v1's interface: classes given as LLM(logits_processors=[...]) that see the rows a
step samples as one batch, learn from a BatchUpdate which requests joined, left or moved since the last step, and
change their logits; per-request options come in SamplingParams.extra_args. AdapterLogitsProcessor runs per-request
functions (vLLM v0's logits processors) through the same interface."""
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import torch

from nanoinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoinfer.config import Config
    from nanoinfer.engine.sequence import Sequence


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # (a, b): b takes a's request; a is left empty
    SWAP = auto()  # (a, b): a and b exchange their requests


RemovedRequest = int  # its batch index
# (batch index, sampling params, prompt token ids, generated token ids: a live view, see OutputTokenIds)
AddedRequest = tuple[int, SamplingParams, list[int], SequenceABC[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How this step's batch differs from the last one's: apply `removed`, then `added`, then `moved` (an added or
    moved request may take an index that held another)."""
    batch_size: int  # the rows of the logits apply() gets
    removed: SequenceABC[RemovedRequest]
    added: SequenceABC[AddedRequest]
    moved: SequenceABC[MovedRequest]


class LogitsProcessor(ABC):
    """Subclass this and pass the class (or "module:Class") in LLM(logits_processors=[...]). Row i of the logits
    apply() gets is the request the BatchUpdates put at index i; the processor changes the rows of the requests it acts
    on (usually those whose extra_args ask for it) and returns the logits (changed in place or not)."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError for params (extra_args, say) this processor cannot take: the request is refused."""

    @abstractmethod
    def __init__(self, config: "Config", device: torch.device, is_pin_memory: bool) -> None:
        """config: the engine's (max_num_seqs, hf_config, ...); device: the logits'."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits [batch_size, vocab] (fp32), as changed by this processor."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if apply() never changes a row's argmax: it then runs only for rows sampled at random, after the
        temperature (greedy rows skip it); False: it runs for every row, before the penalties."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every apply(): batch_update says how the batch changed, None if it did not."""


T = TypeVar("T")


def process_dict_updates(state: dict[int, T], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, list[int], SequenceABC[int]], T | None]) -> None:
    """Keep per-index state through a BatchUpdate: dropped for removed requests, new_state(params, prompt ids,
    output ids) for added ones (None: nothing kept), carried along moves."""
    if batch_update is None:
        return
    for index in batch_update.removed:
        state.pop(index, None)
    for index, params, prompt_ids, output_ids in batch_update.added:
        value = new_state(params, prompt_ids, output_ids)
        if value is None:
            state.pop(index, None)
        else:
            state[index] = value
    for a, b, direction in batch_update.moved:
        moved, other = state.pop(a, None), state.pop(b, None)
        if moved is not None:
            state[b] = moved
        if direction is MoveDirectionality.SWAP and other is not None:
            state[a] = other


# A per-request logits processor: (output ids, logits row) -> logits row, or (prompt ids, output ids, logits row).
RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs a per-request function on each row it applies to: subclass it, implement new_req_logits_processor and
    is_argmax_invariant; a subclass's __init__ calls this one's."""

    def __init__(self, config: "Config", device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}  # batch index -> its function

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The function for a request with these params; None: none applies."""

    def _new_state(self, params: SamplingParams, prompt_ids: list[int], output_ids: SequenceABC[int]
                   ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        with_prompt = len(inspect.signature(fn).parameters) == 3
        return partial(fn, prompt_ids, output_ids) if with_prompt else partial(fn, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, fn in self.req_info.items():
            row = logits[index]
            new = fn(row)
            if new is not row:
                logits[index] = new
        return logits


class OutputTokenIds(SequenceABC):
    """A request's generated token ids as they grow (the live list vLLM hands processors), read-only: len(),
    indexing, slices (lists), iteration, `in`, count()."""
    __slots__ = ("_seq",)

    def __init__(self, seq: "Sequence") -> None:
        self._seq = seq

    def __len__(self) -> int:
        return self._seq.num_completion_tokens

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self._seq.completion_token_ids[i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"output token index {i} out of range ({n} tokens)")
        return self._seq.token_ids[self._seq.num_prompt_tokens + i % n]

    def __iter__(self) -> Iterator[int]:
        return iter(self._seq.completion_token_ids)

    def __repr__(self) -> str:
        return f"OutputTokenIds({self._seq.completion_token_ids})"


def load_logits_processor(spec: object) -> type[LogitsProcessor]:
    """A LogitsProcessor subclass, or one named "module:Class" (vLLM's form), imported."""
    if isinstance(spec, str):
        module_name, sep, qualname = spec.partition(":")
        if not (module_name and sep and qualname):
            raise ValueError(f"logits_processors entry {spec!r} must be a class or 'module:Class'")
        try:
            spec = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"logits_processors entry {spec!r}: cannot import {module_name!r} ({e})") from e
        for name in qualname.split("."):
            if not hasattr(spec, name):
                raise ValueError(f"logits_processors entry '{module_name}:{qualname}': {module_name} has no {qualname}")
            spec = getattr(spec, name)
    if not (isinstance(spec, type) and issubclass(spec, LogitsProcessor)):
        raise TypeError(f"logits_processors entry {spec!r} is not a subclass of nanoinfer.logits_processor."
                        f"LogitsProcessor")
    return spec
