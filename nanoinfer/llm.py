"""`LLM`: the user's entry point for offline generation: batch (`generate`, `chat`, `beam_search`) or streaming
(`generate_iter`); and for pooling (`embed`, `classify`, `score`)."""
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from contextlib import contextmanager
from itertools import count

from tqdm.auto import tqdm

from nanoinfer.beam_search import BeamSearchOutput, BeamSearchParams, beam_search, check_beam_search
from nanoinfer.config import Config
from nanoinfer.engine.llm_engine import LLMEngine, Prompt
from nanoinfer.engine.pooling import POOLING_TYPES
from nanoinfer.engine.sequence import Sequence
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, RequestOutput,
                               ScoringRequestOutput)
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict]
logger = logging.getLogger(__name__)


class _Turns:
    """Who drives the engine: one generate/chat/embed call or one open generate_iter stream at a time. A flag under
    a small lock, not a thread-owned lock: a stream may be advanced, closed or dropped from any thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._held = False
        self.stream_thread: int | None = None  # while a stream holds the turn: the thread that last advanced it

    def acquire(self) -> None:
        with self._cond:
            while self._held:
                if self.stream_thread == threading.get_ident():  # waiting would deadlock: this thread drives it
                    raise RuntimeError("this LLM is driven by an open generate_iter stream: finish or close it first")
                self._cond.wait()
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held, self.stream_thread = False, None
            self._cond.notify()


class LLM:
    """With tensor_parallel_size=N, a plain process starts N - 1 worker processes, stopped by close(), by leaving a
    `with` block, or at interpreter exit; under torchrun, every rank builds an LLM and calls generate (or embed,
    classify, score) alike."""

    def __init__(self, model: str | os.PathLike, **kwargs):
        unknown = sorted(set(kwargs) - Config.field_names())
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {unknown}; known: {sorted(Config.field_names() - {'model'})}")
        self.llm_engine = LLMEngine(Config(model, **kwargs))
        if (defaults := self.llm_engine.config.default_sampling) and self.llm_engine.tp.rank == 0:
            logger.info("Sampling defaults from the model's generation config: %s (generation_config=\"vllm\" "
                        "turns them off)", ", ".join(f"{k}={v}" for k, v in defaults.items()))
        # One engine, one scheduler: generate calls from several threads take turns, and an open stream owns it.
        self._turns = _Turns()
        self._request_ids = count()
        self._finalizer = weakref.finalize(self, self.llm_engine.close)  # also runs at interpreter exit

    def close(self) -> None:
        """Stop the tensor-parallel workers, leave the process group and give back the memory of the model and its
        caches (GPU memory included); generate raises afterwards."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        """vLLM's accessor: the same tokenizer as `tokenizer` (None for a model without one)."""
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate, generate_iter and chat take without sampling_params, as in vLLM: the sampling fields of the
        model's generation config (see Config.generation_config), else SamplingParams()."""
        return SamplingParams(**self.llm_engine.config.default_sampling)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt prefixes, so that the next prompts are computed in full (vLLM's, for benchmarks of
        cold prefills); False, forgetting nothing, while requests added through llm_engine hold KV blocks."""
        with self._turn() as engine:
            return engine.reset_prefix_cache()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """One finished output per prompt, in input order; lora_request: one adapter for all prompts, or one (or
        None) per prompt (needs enable_lora); priority: one per prompt (needs scheduling_policy="priority"). Under
        torchrun every rank must call it; rank 0's prompts are run and every rank returns the same outputs."""
        requests = self._make_requests(prompts, sampling_params, RequestOutputKind.FINAL_ONLY, lora_request, priority)
        with self._turn() as engine:
            return engine.run_on_every_rank(lambda: self._run(requests, use_tqdm))

    def generate_iter(self, prompts: Prompt | list[Prompt],
                      sampling_params: SamplingParams | list[SamplingParams] | None = None,
                      lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                      priority: list[int] | None = None) -> Iterator[RequestOutput]:
        """Outputs as tokens arrive: each step yields the requests it advanced (everything so far, or only the
        new part with output_kind=DELTA); the last output of a request has finished=True. Closing the iterator
        early (break), or dropping it, aborts its unfinished requests and frees their KV blocks. Any thread may
        advance, close or drop it. The stream owns the LLM until it ends: other threads' calls wait for it, while
        the thread that last advanced it gets a RuntimeError (waiting there would never end)."""
        requests = self._make_requests(prompts, sampling_params, None, lora_request, priority)  # bad input raises
        if self.llm_engine.tp.torchrun:
            raise ValueError("generate_iter is not available under torchrun, where every rank runs rank 0's steps: "
                             "use generate")
        return self._stream(requests)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """generate() on one conversation (a list of {"role", "content"} messages, OpenAI's form: see
        _template_messages) or a list of them, rendered with the tokenizer's chat template (vLLM's argument order):
        continue_final_message=True (with add_generation_prompt=False) lets the model go on with the last message
        instead of starting a new one; tools (JSON schemas of functions) go to the template, which may show them."""
        self.llm_engine.check_generates()  # before the template: an encoder's tokenizer has none
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if isinstance(messages, SequenceABC) and messages and all(isinstance(m, dict) for m in messages):
            messages = [messages]
        if not isinstance(messages, SequenceABC) or isinstance(messages, str) or not messages or not all(
                isinstance(c, SequenceABC) and c and all(isinstance(m, dict) for m in c) for c in messages):
            raise TypeError("messages must be a conversation (a non-empty list of message dicts) or a list of them")
        messages = [_template_messages(conversation) for conversation in messages]
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a string, got {type(chat_template).__name__}")
        _check_bool("add_generation_prompt", add_generation_prompt)
        _check_bool("continue_final_message", continue_final_message)
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message=True continues the last message: pass add_generation_prompt=False")
        if tools is not None and (isinstance(tools, str | dict) or not isinstance(tools, SequenceABC)
                                  or not all(isinstance(t, dict) for t in tools)):
            raise TypeError(f"tools must be a list of dicts (JSON schemas of functions), got {tools!r}")
        if not isinstance(chat_template_kwargs, dict | None):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, tools=None if tools is None else list(tools),
                      **(chat_template_kwargs or {}))
        prompts = []
        for conversation in messages:
            ids = self.tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
            prompts.append({"prompt_token_ids": list(ids), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (see nanoinfer/beam_search.py): per prompt, in input order, a BeamSearchOutput whose
        `sequences` are the best `params.beam_width` beams (prompt + completion tokens), best first; lora_request:
        one adapter for all prompts, or one (or None) per prompt, as in generate."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if self.llm_engine.config.logprobs_mode.endswith("logits"):
            raise ValueError(f"beam search ranks beams by logprobs: this LLM reports logits (logprobs_mode="
                             f"{self.llm_engine.config.logprobs_mode!r})")
        params.validate()
        engine = self.llm_engine
        token_ids = [engine.prompt_token_ids(p)[0] for p in _as_prompt_list(prompts)]
        check_beam_search(token_ids, params, engine.vocab_size, engine.config.max_model_len, concurrency_limit)
        loras = _as_lora_list(lora_request, len(token_ids))
        for lora in loras:  # refused before the first step, not when its prompt's turn comes (concurrency_limit)
            engine.check_lora(lora)
        step = params.step_params()
        decode = self.tokenizer.decode if self.tokenizer is not None else None

        def expand(beams: list[list[int]], beam_loras: list[LoRARequest | None]) -> list[RequestOutput]:
            return self._run(self._make_requests(beams, step, None, beam_loras), use_tqdm=False)

        def search() -> list[BeamSearchOutput]:
            return beam_search(token_ids, loras, params, engine.eos_token_ids, expand, decode, use_tqdm,
                               concurrency_limit)

        with self._turn():
            return engine.run_on_every_rank(search)

    def embed(self, prompts: Prompt | list[Prompt], pooling: str | None = None, normalize: bool | None = None,
              causal: bool = False) -> list[EmbeddingRequestOutput]:
        """Each prompt's final hidden states (a decoder's after its final norm), pooled (optionally L2-normalised),
        in `.outputs.embedding`; in input order. pooling: "cls" (the first token), "mean", "last", or None: the
        model's sentence-transformers config's, else "mean"; normalize None: whether that config ends in a Normalize
        module. A decoder runs by default as a bidirectional encoder
        without position encoding; `causal=True`: as it generates (vLLM's embedding of decoder models, e.g.
        Qwen3-Embedding with pooling="last", normalize=True). An encoder (BERT, RoBERTa) runs as it was trained."""
        if pooling is not None and pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be None or one of {list(POOLING_TYPES)}, got {pooling!r}")
        if normalize is not None:
            _check_bool("normalize", normalize)
        _check_bool("causal", causal)
        prompts = _as_prompt_list(prompts)
        with self._turn() as engine:
            return engine.run_on_every_rank(lambda: engine.embed(prompts, pooling, normalize, causal))

    def classify(self, prompts: Prompt | list[Prompt], use_activation: bool = True
                 ) -> list[ClassificationRequestOutput]:
        """A sequence-classification model's label probabilities for each prompt (`.outputs.probs`: vLLM's activation,
        a softmax over the labels or a sigmoid of a single one; the logits with use_activation=False), read at the
        prompt's last token after a causal pass (an encoder's: at its first, after a bidirectional one); in input
        order."""
        _check_bool("use_activation", use_activation)
        prompts = _as_prompt_list(prompts)
        with self._turn() as engine:
            return engine.run_on_every_rank(lambda: engine.classify(prompts, use_activation))

    def score(self, data_1: Prompt | list[Prompt], data_2: Prompt | list[Prompt], use_activation: bool = True
              ) -> list[ScoringRequestOutput]:
        """A cross-encoder's (a classification model with one label) score of each pair: one data_1 against every
        data_2, or data_1[i] against data_2[i]; `.outputs.score`, the sigmoid of the logit (the logit with
        use_activation=False)."""
        _check_bool("use_activation", use_activation)
        first, second = _as_prompt_list(data_1), _as_prompt_list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"data_1 has {len(first)} prompts and data_2 {len(second)}: give one data_1, or as many "
                             f"as data_2")
        with self._turn() as engine:
            return engine.run_on_every_rank(lambda: engine.score(list(zip(first, second)), use_activation))

    def _make_requests(self, prompts: Prompt | list[Prompt],
                       sampling_params: SamplingParams | list[SamplingParams] | None,
                       kind: RequestOutputKind | None,
                       lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                       priority: list[int] | None = None) -> list[list[Sequence]]:
        """Validate everything before queueing anything: a bad prompt leaves the engine untouched."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(self.get_default_sampling_params() if sampling_params is None else sampling_params,
                                 len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        priorities = _as_priority_list(priority, len(prompts))
        if kind is not None:
            replaced = {id(p): dataclasses.replace(p, output_kind=kind) for p in params if isinstance(p, SamplingParams)}
            params = [replaced.get(id(p), p) for p in params]
        return [self.llm_engine.make_sequences(self._next_request_id(), prompt, p, lora, rank)
                for prompt, p, lora, rank in zip(prompts, params, loras, priorities)]

    def _next_request_id(self) -> str:
        """A fresh id, skipping any that a request added through the step API holds."""
        while self.llm_engine.request_id_in_use(rid := str(next(self._request_ids))):
            pass
        return rid

    @contextmanager
    def _turn(self) -> Iterator[LLMEngine]:
        """Hold the engine (after other threads' calls and streams), if it is still open."""
        self._turns.acquire()
        try:
            if self.llm_engine.closed:
                raise RuntimeError("this LLM is closed")
            yield self.llm_engine
        finally:
            self._turns.release()

    def _run(self, requests: list[list[Sequence]], use_tqdm: bool) -> list[RequestOutput]:
        engine, done, ids = self.llm_engine, {}, {seqs[0].request_id for seqs in requests}
        bar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        start, generated = time.perf_counter(), 0
        try:
            for seqs in requests:
                engine.enqueue(seqs)
            while len(done) < len(requests):
                outputs = engine.step_for(ids)
                if not outputs:
                    continue
                for out in outputs:
                    done[out.request_id] = out
                    generated += sum(len(c.token_ids) for c in out.outputs)
                # Shown by the update: the bar changes only when requests finish.
                bar.set_postfix(output=f"{generated / (time.perf_counter() - start):.0f}tok/s", refresh=False)
                bar.update(len(outputs))
        finally:
            bar.close()
            engine.abort_request(ids)  # those left unfinished by a failure or Ctrl-C: the engine stays usable
        return [done[seqs[0].request_id] for seqs in requests]

    def _stream(self, requests: list[list[Sequence]]) -> Iterator[RequestOutput]:
        with self._turn() as engine:
            ids = {seqs[0].request_id for seqs in requests}
            try:
                for seqs in requests:
                    engine.enqueue(seqs)
                while any(rid in engine.requests for rid in ids):
                    self._turns.stream_thread = threading.get_ident()
                    for out in engine.step_for(ids):
                        yield out
                        self._turns.stream_thread = threading.get_ident()  # resumed, maybe by another thread
            finally:
                engine.abort_request(ids)  # those left unfinished: closed or dropped early, or a failed step


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray, memoryview)) or not isinstance(prompts, SequenceABC):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("no prompts given")
    if any(isinstance(t, int) for t in prompts):  # one prompt of token ids (a bad id in it is named later)
        return [list(prompts)]
    return list(prompts)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _template_messages(conversation: Conversation) -> Conversation:
    """The messages as chat templates take them (copies), from OpenAI's form as vLLM accepts it: a string role; a
    string content, or a list of text parts ({"type": "text", "text": ...}, joined by newlines as vLLM joins them
    for templates that render a string), or none (None or absent) on a message with tool_calls, whose arguments
    given as JSON text become dicts (what templates iterate over). Chat templates fail obscurely on anything else."""
    out = []
    for i, message in enumerate(conversation):
        message = dict(message)
        if "role" not in message:
            raise ValueError(f"chat message {i} has no 'role': {message!r}")
        if not isinstance(message["role"], str):
            raise TypeError(f"chat message {i}: 'role' must be a string, got {message['role']!r}")
        content = message.get("content")
        if "tool_calls" in message:
            if not isinstance(message["tool_calls"], list):
                raise TypeError(f"chat message {i}: 'tool_calls' must be a list, got {message['tool_calls']!r}")
            message["tool_calls"] = [_template_tool_call(i, call) for call in message["tool_calls"]]
        elif "content" not in message:
            raise ValueError(f"chat message {i} has no 'content': {message!r}")
        if isinstance(content, list):
            message["content"] = "\n".join(_text_part(i, part) for part in content)
        elif not (isinstance(content, str) or content is None and "tool_calls" in message):
            raise TypeError(f"chat message {i}: 'content' must be a string or a list of text parts, got {content!r}")
        out.append(message)
    return out


def _text_part(i: int, part: object) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError(f"chat message {i}: a content part must be {{'type': 'text', 'text': str}} (this model reads "
                         f"text only), got {part!r}")
    return part["text"]


def _template_tool_call(i: int, call: object) -> dict:
    """A tool call with its function's arguments as a dict (OpenAI's messages carry them as JSON text)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise TypeError(f"chat message {i}: a tool call must be {{'function': {{'name': str, 'arguments': ...}}}}, "
                        f"got {call!r}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"chat message {i}: tool call {function['name']!r} has arguments that are not JSON: "
                             f"{function['arguments']!r} ({e})") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _as_lora_list(lora_request: LoRARequest | list[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    """Each entry is checked by the engine (LLMEngine.make_sequences)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    return _one_per_prompt(lora_request, n, "lora_request must be a LoRARequest or a list of them", "lora requests")


def _as_priority_list(priority: list[int] | None, n: int) -> list[int]:
    """Each entry is checked by the engine (LLMEngine.make_sequences)."""
    if priority is None:
        return [0] * n
    return _one_per_prompt(priority, n, "priority must be a list of ints, one per prompt", "priorities")


def _as_params_list(params: SamplingParams | list[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    return _one_per_prompt(params, n, "sampling_params must be SamplingParams or a list of them", "sampling params")


def _one_per_prompt(values: object, n: int, what: str, plural: str) -> list:
    """values as a list of exactly n, one per prompt; TypeError (`what`, the type given) or ValueError otherwise."""
    if isinstance(values, str) or not isinstance(values, SequenceABC):
        raise TypeError(f"{what}, got {type(values).__name__}")
    values = list(values)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {plural} for {n} prompts")
    return values
