"""Turns prompts into sequences, steps the scheduler and the model runner, and collects finished requests."""
import pickle
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanoinfer.config import Config
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.parallel import start_tensor_parallel
from nanoinfer.engine.scheduler import ScheduledBatch, Scheduler
from nanoinfer.engine.sequence import Sequence
from nanoinfer.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.utils.gguf_loader import load_gguf_tokenizer

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = _load_tokenizer(config)
        self.tp = start_tensor_parallel(config)
        try:
            self.model_runner = ModelRunner(config, self.tp)
        except BaseException as e:
            dead = self.tp.abort()
            if dead is None:
                raise
            raise RuntimeError(f"tensor-parallel start-up failed: {dead}") from e
        self.scheduler = Scheduler(config, self.model_runner.num_kvcache_blocks, self.model_runner.num_state_slots)
        self.vocab_size: int = config.hf_config.vocab_size

    def make_sequence(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        """Validate one request and wrap it; nothing is queued, so a bad request leaves the engine untouched."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        token_ids, text = self.prompt_token_ids(prompt)
        if len(token_ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens + max_tokens={params.max_tokens} exceeds "
                             f"max_model_len={self.config.max_model_len}")
        return Sequence(token_ids, params, self.config.kvcache_block_size, prompt=text)

    def prompt_token_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """A prompt's checked token ids, and its text if it was given as a string."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, SequenceABC):
            token_ids, text = list(prompt), None
            bad = next((t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)), None)
            if bad is not None:
                raise TypeError(f"token ids must be ints, got {bad!r}")
        else:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        # Tokenizer output too: a tokenizer may know added tokens the model's embedding does not.
        out_of_range = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if out_of_range is not None:
            raise ValueError(f"token id {out_of_range} is outside the vocabulary [0, {self.vocab_size})")
        return token_ids, text

    def embed(self, prompts: list[Prompt], pooling: str, normalize: bool) -> list[EmbeddingRequestOutput]:
        """Pooled encoder states (see ModelRunner.encode), in batches of at most max_num_batched_tokens tokens."""
        if self.config.tensor_parallel_size > 1:
            raise ValueError("embed does not support tensor parallelism yet")
        checked = [self.prompt_token_ids(p) for p in prompts]  # all validated before any runs
        too_long = next((len(ids) for ids, _ in checked if len(ids) > self.config.max_model_len), None)
        if too_long is not None:
            raise ValueError(f"prompt of {too_long} tokens exceeds max_model_len={self.config.max_model_len}")
        states: list[torch.Tensor] = []
        batch: list[list[int]] = []
        for ids, _ in checked + [([], None)]:  # the empty sentinel flushes the last batch
            if batch and (not ids or sum(map(len, batch)) + len(ids) > self.config.max_num_batched_tokens):
                states += self.model_runner.encode(batch)
                batch = []
            batch.append(ids)
        pooled = [h.float().mean(0) if pooling == "mean" else h[-1].float() for h in states]
        if normalize:
            pooled = [F.normalize(e, dim=0) for e in pooled]
        return [EmbeddingRequestOutput(next(Sequence.ids), text, ids, EmbeddingOutput(e.tolist()))
                for (ids, text), e in zip(checked, pooled)]

    def add_request(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        seq = self.make_sequence(prompt, params)
        self.scheduler.add(seq)
        return seq

    def step(self) -> tuple[list[Sequence], ScheduledBatch]:
        batch = self.scheduler.schedule()
        try:
            token_ids = self.model_runner.run(batch)
        except BaseException as e:
            self._fail(e)
            raise
        return self.scheduler.postprocess(batch, token_ids), batch

    def _fail(self, error: BaseException) -> None:
        """A rank that fails mid-step leaves the others waiting in a collective: with tensor parallelism, the whole
        group is shut down and the error says which worker died, if one did."""
        if self.tp.size == 1:
            return
        dead = self.tp.abort()
        if isinstance(error, Exception):
            raise RuntimeError(f"tensor-parallel step failed on rank {self.tp.rank} ({dead or error}); "
                               "this LLM is closed, create a new one") from error

    def run_on_every_rank(self, generate: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:
        """Under torchrun every rank calls generate: rank 0 runs it while the others serve its steps; then every
        rank returns rank 0's outputs (or raises its error)."""
        if self.tp.rank > 0:
            try:
                self.model_runner.serve()
                result = self.tp.broadcast()
            except BaseException as e:
                self._fail(e)
                raise
        else:
            try:
                result = generate()
            except Exception as e:  # noqa: BLE001 - sent to the other ranks, raised below
                result = e
            if not self.tp.closed:
                self.tp.broadcast(None)  # ends serve() on the other ranks
                try:
                    self.tp.broadcast(result)
                except (pickle.PicklingError, TypeError, AttributeError):
                    self.tp.broadcast(RuntimeError(f"rank 0 failed: {result!r}"))
        if isinstance(result, BaseException):
            raise result
        return result

    @property
    def closed(self) -> bool:
        return self.tp.closed

    def close(self) -> None:
        self.tp.close()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def abort_all(self) -> None:
        self.scheduler.abort_all()

    def to_output(self, seq: Sequence) -> RequestOutput:
        completion = seq.completion_token_ids
        text = self.tokenizer.decode(completion, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(seq.seq_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], completion, text,
                             seq.finish_reason, seq.num_cached_tokens)


def _load_tokenizer(config: Config) -> PreTrainedTokenizerBase | None:
    if config.gguf_path is not None:
        return load_gguf_tokenizer(config.gguf_path)
    has_tokenizer = any((config.model_path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    return AutoTokenizer.from_pretrained(config.model_path) if has_tokenizer else None
