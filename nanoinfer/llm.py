"""`LLM`: the user's entry point for offline batch generation."""
import os
import threading
import time
import weakref
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from nanoinfer.config import Config
from nanoinfer.engine.llm_engine import LLMEngine, Prompt
from nanoinfer.outputs import EmbeddingRequestOutput, RequestOutput
from nanoinfer.sampling_params import SamplingParams


class LLM:
    """With tensor_parallel_size=N, a plain process starts N - 1 worker processes, stopped by close(), by leaving a
    `with` block, or at interpreter exit; under torchrun, every rank builds an LLM and calls generate."""

    def __init__(self, model: str | os.PathLike, **kwargs):
        unknown = sorted(set(kwargs) - Config.field_names())
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {unknown}; known: {sorted(Config.field_names() - {'model'})}")
        self.llm_engine = LLMEngine(Config(model, **kwargs))
        self._lock = threading.Lock()  # one engine, one scheduler: concurrent generate calls take turns
        self._finalizer = weakref.finalize(self, self.llm_engine.close)  # also runs at interpreter exit

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group; generate raises afterwards."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in input order. Under torchrun every rank must call it; rank 0's prompts are
        run and every rank returns the same outputs."""
        with self._lock:
            if self.llm_engine.closed:
                raise RuntimeError("this LLM is closed")
            if self.llm_engine.tp.torchrun:
                return self.llm_engine.run_on_every_rank(
                    lambda: self._generate(_as_prompt_list(prompts), sampling_params, use_tqdm))
            return self._generate(_as_prompt_list(prompts), sampling_params, use_tqdm)

    def embed(self, prompts: Prompt | list[Prompt], pooling: str = "mean",
              normalize: bool = False) -> list[EmbeddingRequestOutput]:
        """The model as a bidirectional encoder without position encoding: each prompt's final-norm hidden states,
        mean- or last-token-pooled (optionally L2-normalised), in `.outputs.embedding`; in input order."""
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be 'mean' or 'last', got {pooling!r}")
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {normalize!r}")
        with self._lock:
            return self.llm_engine.embed(_as_prompt_list(prompts), pooling, normalize)

    def _generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None,
                  use_tqdm: bool) -> list[RequestOutput]:
        params = _as_params_list(sampling_params, len(prompts))
        engine = self.llm_engine
        seqs = [engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]
        for seq in seqs:
            engine.scheduler.add(seq)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        throughput = {}
        try:
            while not engine.is_finished():
                t = time.perf_counter()
                finished, batch = engine.step()
                kind = "prefill" if batch.is_prefill else "decode"
                throughput[kind] = f"{sum(batch.num_new_tokens) / (time.perf_counter() - t):.0f}tok/s"
                bar.set_postfix(throughput, refresh=False)
                bar.update(len(finished))
        except BaseException:
            engine.abort_all()  # leave no half-finished requests behind: the engine stays usable
            raise
        finally:
            bar.close()
        return [engine.to_output(seq) for seq in seqs]


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, SequenceABC):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not prompts:
        raise ValueError("no prompts given")
    return list(prompts)


def _as_params_list(params: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, str) or not isinstance(params, SequenceABC):
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
