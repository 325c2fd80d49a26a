"""Turns requests into sequences, steps the scheduler and the model runner, checks stops, and reports outputs
(vLLM's step API: add_request, step, abort_request)."""
import copy
import dataclasses
import logging
import pickle
import time
from collections.abc import Callable, Container, Iterable
from collections.abc import Sequence as SequenceABC
from typing import TypeVar

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanoinfer.config import TOKENIZER_FILES, Config
from nanoinfer.engine.model_runner import LaunchedStep, ModelRunner, RunnerOutput, TokenLogprobs
from nanoinfer.engine.parallel import start_tensor_parallel
from nanoinfer.engine.pooling import model_normalizes, model_pooling
from nanoinfer.engine.scheduler import ScheduledBatch, Scheduler
from nanoinfer.engine.sequence import Sequence
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                               EmbeddingRequestOutput, Logprob, RequestMetrics, RequestOutput, ScoringOutput,
                               ScoringRequestOutput)
from nanoinfer.models.bert import has_token_types, with_token_types
from nanoinfer.models.registry import is_classifier, is_encoder
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams, bad_words_token_ids
from nanoinfer.spec_decode.config import SpecDecodeStats
from nanoinfer.structured.grammar import Grammar, GrammarCache, GrammarState
from nanoinfer.utils.gguf_loader import load_gguf_tokenizer

# A prompt: text, token ids, or a dict with "prompt_token_ids" (and optionally its "prompt" text) or "prompt".
Prompt = str | list[int] | dict
_Batch = TypeVar("_Batch")
_Result = TypeVar("_Result")
_Prompt = TypeVar("_Prompt", list[int], torch.Tensor)

logger = logging.getLogger(__name__)


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
        self.scheduler = Scheduler(config, self.model_runner.num_kvcache_blocks, self.model_runner.num_state_slots,
                                   config.max_loras, config.speculative)
        self.vocab_size: int = config.hf_config.vocab_size
        self.is_classifier = is_classifier(config.hf_config.architectures)  # it pools and classifies, never generates
        self.is_encoder = is_encoder(config.hf_config.architectures)  # BERT, RoBERTa: it pools, never generates
        # A scored pair's token types go to the model (BERT's); other models see the pair's token ids alone.
        self.token_types = self.is_encoder and has_token_types(config.hf_config)
        self.eos_token_ids = _sampleable_eos_token_ids(config, self.vocab_size)
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size)  # structured outputs' compiled regexes
        self.token_texts: dict[int, str] = {}  # see _token_text
        self.requests: dict[str, list[Sequence]] = {}  # unfinished requests: their n completions
        # Outputs of step-API requests produced while LLM.generate/generate_iter drove the steps: step() returns them.
        self.held_outputs: list[RequestOutput] = []
        self.last_batch: ScheduledBatch | None = None  # what the latest step computed (for statistics)
        # With async_scheduling: the step launched ahead by the previous step(), which the next one completes.
        self.in_flight: LaunchedStep | None = None
        # Custom logits processors read the generated tokens on the host (OutputTokenIds): with them no step runs
        # ahead of the one in flight.
        self.runs_ahead = config.async_scheduling and not config.logits_processor_classes
        self.spec_decode_stats = SpecDecodeStats()  # drafted and accepted tokens, with speculative_config

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        self._check_open()
        self.enqueue(self.make_sequences(request_id, prompt, params, lora_request, priority))

    def make_sequences(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       lora_request: LoRARequest | None = None, priority: int = 0) -> list[Sequence]:
        """Validate one request and wrap its n completions; nothing is queued, so a bad request leaves the engine
        untouched. priority: with scheduling_policy="priority", lower runs first (vLLM's rule)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if self.request_id_in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        self.check_generates()
        params.validate()  # its fields may have changed since construction
        params = _own_copy(params)
        for processor in self.config.logits_processor_classes:
            processor.validate_params(params)
        embeds = self._prompt_embeds(prompt, params) if isinstance(prompt, dict) and "prompt_embeds" in prompt else None
        if embeds is None:
            token_ids, text = self.prompt_token_ids(prompt)
            token_ids = self._truncated(token_ids, params.truncate_prompt_tokens)
        else:
            token_ids, text = [0] * len(embeds), None  # placeholders: see Sequence.prompt_embeds
        for name, ids in (("stop token id", params.stop_token_ids), ("logit_bias token id", params.logit_bias or ()),
                          ("allowed_token_ids token id", params.allowed_token_ids or ())):
            self._check_in_vocabulary(name, ids)
        bad_words = self._bad_words_token_ids(params.bad_words)
        self._check_allowed_tokens_left(params, bad_words)
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.vocab_size:
                raise ValueError(f"{name}={getattr(params, name)} exceeds the vocabulary size {self.vocab_size}")
        max_tokens = self.config.max_model_len - len(token_ids) if params.max_tokens is None else params.max_tokens
        if max_tokens < max(1, params.min_tokens) or len(token_ids) + max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens + max_tokens={max_tokens} (min_tokens="
                             f"{params.min_tokens}) exceeds max_model_len={self.config.max_model_len}")
        grammar = self._grammar(params)
        self.check_lora(lora_request)
        self._check_priority(priority)
        metrics = RequestMetrics(arrival_time=time.time())
        params = _whole_vocabulary_logprobs(params, self.vocab_size)
        return [Sequence(token_ids, _child_params(params, i), self.config.kvcache_block_size, prompt=text,
                         request_id=request_id, index=i, max_tokens=max_tokens,
                         eos_token_ids=frozenset(self.eos_token_ids), metrics=metrics, bad_words_token_ids=bad_words,
                         grammar=grammar, lora_request=lora_request, priority=priority, prompt_embeds=embeds)
                for i in range(params.n)]

    def _prompt_embeds(self, prompt: dict, params: SamplingParams) -> torch.Tensor:
        """A prompt given as {"prompt_embeds": [tokens, hidden] tensor} (vLLM's EmbedsPrompt), checked, truncated as
        params say, in the model's dtype on the host."""
        if set(prompt) != {"prompt_embeds"}:
            raise ValueError(f"a prompt of embeddings holds only 'prompt_embeds', got keys {sorted(prompt)}")
        if not self.config.enable_prompt_embeds:
            raise ValueError("prompt_embeds needs LLM(enable_prompt_embeds=True)")
        embeds, hidden = prompt["prompt_embeds"], self.model_runner.prompt_embedding.embedding_dim
        if not isinstance(embeds, torch.Tensor) or not embeds.is_floating_point():
            raise TypeError(f"'prompt_embeds' must be a floating-point torch.Tensor, got "
                            f"{embeds.dtype if isinstance(embeds, torch.Tensor) else type(embeds).__name__}")
        if embeds.dim() != 2 or embeds.shape[0] == 0 or embeds.shape[1] != hidden:
            raise ValueError(f"'prompt_embeds' must be [tokens > 0, {hidden}] (the model's embedding width), got "
                             f"{list(embeds.shape)}")
        if params.prompt_logprobs is not None:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} needs the prompt's token ids: a prompt of "
                             "embeddings has none")
        embeds = self._truncated(embeds, params.truncate_prompt_tokens)
        return embeds.detach().to("cpu", self.config.torch_dtype).contiguous()

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' (this engine's is "
                             f"{self.config.scheduling_policy!r})")

    def check_generates(self) -> None:
        """A model that only pools (a classifier, an encoder) is refused generation, naming it."""
        if not (self.is_classifier or self.is_encoder):
            return
        kind, use = (("a sequence-classification", "LLM.classify or LLM.score") if self.is_classifier
                     else ("an encoder-only", "LLM.embed"))
        raise ValueError(f"{self.config.model_path} is {kind} model ({self.config.hf_config.architectures[0]}) "
                         f"and does not generate: use {use}")

    def _grammar(self, params: SamplingParams) -> Grammar | None:
        """params.structured_outputs compiled (cached by regex); ValueError when it cannot be, or when it cannot
        produce a first token (only EOS would do, and ignore_eos or min_tokens withholds it)."""
        if params.structured_outputs is None:
            return None
        grammar = self.grammars.get(params.structured_outputs)
        eos_allowed = bool(self.eos_token_ids) and not params.ignore_eos and params.min_tokens == 0
        if GrammarState(grammar).exhausted(eos_allowed):
            raise ValueError(f"{params.structured_outputs.describe()} matches only the empty output, which "
                             f"ignore_eos={params.ignore_eos} / min_tokens={params.min_tokens} rule out")
        return grammar

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """The adapter is read and checked against the model here, once per lora_int_id (see LoRAModel.check)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if not self.config.enable_lora:
            raise ValueError(f"lora_request={lora_request!r} given, but LoRA is off: create the LLM with "
                             "enable_lora=True")
        self.model_runner.lora.check(lora_request)

    def _truncated(self, token_ids: _Prompt, keep: int | None) -> _Prompt:
        """truncate_prompt_tokens (vLLM's): the last `keep` tokens of the prompt (ids or embeddings); -1 keeps
        max_model_len."""
        if keep is None:
            return token_ids
        max_len = self.config.max_model_len
        if keep > max_len:
            raise ValueError(f"truncate_prompt_tokens={keep} exceeds max_model_len={max_len}")
        return token_ids[-(max_len if keep == -1 else keep):]

    def _check_in_vocabulary(self, name: str, token_ids: Iterable[int]) -> None:
        out_of_range = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if out_of_range is not None:
            raise ValueError(f"{name} {out_of_range} is outside the vocabulary [0, {self.vocab_size})")

    def _check_allowed_tokens_left(self, params: SamplingParams, bad_words: tuple[tuple[int, ...], ...]) -> None:
        """A ValueError where allowed_token_ids leave nothing to sample at some step: all banned by one-token bad
        words, or all EOS or stop tokens, which min_tokens withholds (the sampler would draw from all -inf)."""
        if params.allowed_token_ids is None:
            return
        banned = {ids[0] for ids in bad_words if len(ids) == 1}
        if params.min_tokens:
            banned |= set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self.eos_token_ids)
        if banned.issuperset(params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids={params.allowed_token_ids} leave nothing to sample: each is banned "
                             f"by bad_words={params.bad_words!r} or is an EOS or stop token (stop_token_ids="
                             f"{params.stop_token_ids}) that min_tokens={params.min_tokens} withholds")

    def _bad_words_token_ids(self, bad_words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        if not bad_words:
            return ()
        if self.tokenizer is None:
            raise ValueError(f"bad_words={bad_words!r} needs a tokenizer, and this model has none")
        token_ids = bad_words_token_ids(bad_words, self.tokenizer)
        self._check_in_vocabulary(f"bad_words={bad_words!r}: token id", (t for ids in token_ids for t in ids))
        return tuple(map(tuple, token_ids))

    def request_id_in_use(self, request_id: str) -> bool:
        """Unfinished, or finished with outputs that step() has not returned yet."""
        return request_id in self.requests or any(o.request_id == request_id for o in self.held_outputs)

    def prompt_token_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """A prompt's checked token ids, and its text if it was given as one."""
        token_ids, text = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        # Tokenizer output too: a tokenizer may know added tokens the model's embedding does not.
        out_of_range = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if out_of_range is not None:
            raise ValueError(f"token id {out_of_range} is outside the vocabulary [0, {self.vocab_size})")
        return token_ids, text

    def embed(self, prompts: list[Prompt], pooling: str | None, normalize: bool | None, causal: bool
              ) -> list[EmbeddingRequestOutput]:
        """Pooled final hidden states (see ModelRunner.encode); pooling and normalize None: the model's own (see
        model_pooling and model_normalizes)."""
        if causal and self.is_encoder:
            raise ValueError(f"causal=True: {self.config.model_path} is an encoder-only model "
                             f"({self.config.hf_config.architectures[0]}), bidirectional only")
        pooling = pooling or model_pooling(self.config.model_path)
        checked = self._pooling_prompts("embed", prompts)
        pooled = self._in_batches([ids for ids, _ in checked],
                                  lambda batch: self.model_runner.encode(batch, causal, pooling))
        if model_normalizes(self.config.model_path) if normalize is None else normalize:
            pooled = [F.normalize(e, dim=0) for e in pooled]
        return [EmbeddingRequestOutput(next(Sequence.ids), text, ids, EmbeddingOutput(e.tolist()))
                for (ids, text), e in zip(checked, pooled)]

    def classify(self, prompts: list[Prompt], use_activation: bool, task: str = "classify",
                 token_types: list[list[int]] | None = None) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (see ModelRunner.classify and _activation), or logits; token_types: each
        prompt's, for a model that reads them (see models/bert.py)."""
        checked = self._pooling_prompts(task, prompts, classifier=True)
        inputs = [ids for ids, _ in checked]
        if token_types is not None:
            inputs = [with_token_types(ids, types) for ids, types in zip(inputs, token_types)]
        logits = torch.stack(self._in_batches(inputs, self.model_runner.classify))
        probs = _activation(logits) if use_activation else logits
        return [ClassificationRequestOutput(next(Sequence.ids), text, ids, ClassificationOutput(p.tolist()))
                for (ids, text), p in zip(checked, probs)]

    def score(self, pairs: list[tuple[Prompt, Prompt]], use_activation: bool) -> list[ScoringRequestOutput]:
        """A one-label classifier as a cross-encoder: the score of each (query, document) pair read as one prompt,
        two texts through the tokenizer's pair encoding, anything else as the two sides' token ids joined; with
        their token types where the model reads them (BERT's)."""
        if self.is_classifier and self.config.hf_config.num_labels != 1:
            raise ValueError(f"score needs a classification model with num_labels=1 (a cross-encoder); "
                             f"{self.config.model_path} has num_labels={self.config.hf_config.num_labels}")
        joined = [self._pair_prompt(a, b) for a, b in pairs]
        token_types = [types for _, types in joined] if self.token_types else None
        return [ScoringRequestOutput(out.request_id, None, out.prompt_token_ids,
                                     ScoringOutput(out.outputs.probs[0]))
                for out in self.classify([ids for ids, _ in joined], use_activation, "score", token_types)]

    def _pair_prompt(self, first: Prompt, second: Prompt) -> tuple[list[int], list[int]]:
        """The pair's token ids and token types: the tokenizer's for two texts (all 0 where it gives none), else 0
        for the first side's ids and 1 for the second's."""
        if isinstance(first, str) and isinstance(second, str) and self.tokenizer is not None:
            encoding = self.tokenizer(first, second)
            ids = encoding["input_ids"]
            return ids, encoding.get("token_type_ids") or [0] * len(ids)
        first_ids, second_ids = self._tokenize(first)[0], self._tokenize(second)[0]
        return first_ids + second_ids, [0] * len(first_ids) + [1] * len(second_ids)

    def _pooling_prompts(self, task: str, prompts: list[Prompt], classifier: bool = False
                         ) -> list[tuple[list[int], str | None]]:
        """Every prompt validated before any runs: token ids and text of each."""
        if classifier and not self.is_classifier:
            raise ValueError(f"{task} needs a sequence-classification model (*ForSequenceClassification); "
                             f"{self.config.model_path} is {self.config.hf_config.architectures}")
        checked = [self.prompt_token_ids(p) for p in prompts]
        too_long = next((len(ids) for ids, _ in checked if len(ids) > self.config.max_model_len), None)
        if too_long is not None:
            raise ValueError(f"prompt of {too_long} tokens exceeds max_model_len={self.config.max_model_len}")
        return checked

    def _in_batches(self, prompts: list[list[int]], run: Callable[[list[list[int]]], Iterable]) -> list:
        """run's results (one per prompt) over consecutive batches of at most max_num_batched_tokens tokens."""
        results, batch = [], []
        for ids in prompts + [[]]:  # the empty sentinel flushes the last batch
            if batch and (not ids or sum(map(len, batch)) + len(ids) > self.config.max_num_batched_tokens):
                results.append(self._run_model(run, batch))
                batch = []
            batch.append(ids)
        return [r for result in results for r in result]

    def _tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_embeds" in prompt:
                raise ValueError("prompt_embeds are taken by generate, generate_iter and add_request only")
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or not prompt:
                raise ValueError(f"a prompt dict holds 'prompt' and/or 'prompt_token_ids', got keys {sorted(prompt)}")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"'prompt' must be a string, got {type(text).__name__}")
            if "prompt_token_ids" not in prompt:
                return self._tokenize(text)
            return _token_ids("'prompt_token_ids'", prompt["prompt_token_ids"]), text
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, SequenceABC) and not isinstance(prompt, _BYTES):
            return _token_ids("token ids", prompt), None
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def enqueue(self, seqs: list[Sequence]) -> None:
        self.requests[seqs[0].request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the outputs of the requests it advanced (per their output_kind), after
        the held outputs of steps that LLM.generate/generate_iter ran meanwhile."""
        outputs = self._step()
        held, self.held_outputs = self.held_outputs, []
        return held + outputs

    def step_for(self, request_ids: Container[str]) -> list[RequestOutput]:
        """One step on behalf of some requests (LLM.generate): their outputs; other requests' are held for step()."""
        mine = []
        for out in self._step():
            (mine if out.request_id in request_ids else self.held_outputs).append(out)
        return mine

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed (its model and caches are freed): create a new LLM")

    def _step(self) -> list[RequestOutput]:
        """Complete a step: the one launched ahead by the previous call, else one scheduled now. With
        async_scheduling the next step is scheduled and launched first, so that the device runs it while the host
        waits for this one's tokens and checks their stops."""
        self._check_open()
        # Taken before anything can fail: an exception leaves nothing in flight, and the scheduler rolls back.
        launched, self.in_flight = self.in_flight, None
        if launched is None:
            launched = self._launch(self.scheduler.schedule())
            if launched is None:
                return []
        ahead = self._launch(self.scheduler.schedule(ahead=True)) if self.runs_ahead else None
        outputs = self._complete(launched)
        self.in_flight = ahead
        return outputs

    def _launch(self, batch: ScheduledBatch | None) -> LaunchedStep | None:
        """Queue a scheduled batch on the model runner (None: nothing to run), noting when its new requests start."""
        if batch is None or not batch.seqs:
            return None
        now = time.time()
        for seq in batch.seqs[batch.num_running:]:  # admitted by this step (maybe again, after a preemption)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        return self._run_model(self.model_runner.launch, batch)

    def _complete(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens, append them, check stops; the outputs of the requests it advanced."""
        batch = self.last_batch = launched.batch
        result = self._run_model(self.model_runner.collect, launched)
        self._record_logprobs(batch, result)
        now = time.time()
        advanced: dict[str, None] = {}
        final_only = RequestOutputKind.FINAL_ONLY  # looked up once: an Enum member costs ~0.3 us on Python 3.11
        accepted = self._accepted_drafts(batch, result) if batch.draft_token_ids else None
        for seq in self.scheduler.postprocess(batch, result.token_ids):
            m = seq.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.num_generation_tokens += 1
            self._check_stop(seq)
            if seq.grammar_state is not None and seq.finish_reason is None:
                self._check_grammar(seq)
            if accepted is not None and seq.seq_id in accepted:
                self._append_accepted(seq, *accepted[seq.seq_id])
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            elif seq.params.output_kind is final_only:
                continue  # nothing to report before the request finishes
            advanced[seq.request_id] = None
        return [out for rid in advanced if (out := self._output(rid)) is not None]

    def _accepted_drafts(self, batch: ScheduledBatch, result: RunnerOutput
                         ) -> dict[int, tuple[list[int], list[TokenLogprobs] | None]]:
        """seq_id -> the verified tokens (and logprobs) that follow its first new token, for the drafted sequences;
        counted in spec_decode_stats."""
        stats, accepted = self.spec_decode_stats, {}
        for i, drafts in batch.draft_token_ids.items():
            tokens = result.extra_token_ids[i]
            stats.num_drafts += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += len(tokens)
            accepted[batch.seqs[i].seq_id] = tokens, result.extra_logprobs and result.extra_logprobs[i]
        return accepted

    def _append_accepted(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs] | None) -> None:
        """Emit accepted tokens one by one, as if each came from its own step: every stop check after each, and none
        after a stop. The blocks they filled join the prefix cache."""
        for j, token in enumerate(tokens):
            if seq.finish_reason is not None:
                break
            self.scheduler.accept_draft(seq, token)
            seq.metrics.num_generation_tokens += 1
            if logprobs:
                seq.logprobs.append(self._logprob_dict(logprobs[j], seq.params.logprobs, seq.params.detokenize))
                seq.cumulative_logprob += logprobs[j][1][0]
            self._check_stop(seq)
        self.scheduler.commit_accepted(seq)

    def _run_model(self, run: Callable[[_Batch], _Result], batch: _Batch) -> _Result:
        """run(batch) on the model runner (a step's launch or collect, a pooling pass); if it fails, with tensor
        parallelism, the group is shut down (_fail)."""
        try:
            return run(batch)
        except BaseException as e:
            self._fail(e)
            raise

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Drop requests (unknown or finished ones are ignored), their held outputs, and free their KV blocks."""
        ids = _request_id_list(request_ids)
        for rid in ids:
            for seq in self.requests.pop(rid, []):
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
        if self.held_outputs:
            self.held_outputs = [o for o in self.held_outputs if o.request_id not in ids]

    def abort_all(self) -> None:
        self.scheduler.abort_all()
        self.requests.clear()
        self.held_outputs.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; False, forgetting nothing, while requests hold KV blocks (see
        BlockManager.reset_prefix_cache). A step in flight whose sequences all finished (async scheduling: launched
        before their last tokens stopped them) completes first."""
        self._check_open()
        while self.in_flight is not None and all(seq.is_finished for seq in self.in_flight.batch.seqs):
            self.held_outputs += self._step()
        return self.in_flight is None and self.scheduler.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Whether step() has more to return: requests to run, or held outputs."""
        return bool(self.requests or self.held_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests.keys() | {o.request_id for o in self.held_outputs})

    def _fail(self, error: BaseException) -> None:
        """A rank that fails mid-step leaves the others waiting in a collective: with tensor parallelism, the whole
        group is shut down and the error names the worker that failed (died, stopped, or silent past the timeout)."""
        if self.tp.size == 1:
            return
        self.model_runner.graph_runner = None  # before the communicator is aborted (see close); nothing else waits
        failed = self.tp.abort(error)
        if isinstance(error, Exception):
            raise RuntimeError(f"tensor-parallel step failed on rank {self.tp.rank} ({failed or error}); "
                               "this LLM is closed, create a new one") from error

    def run_on_every_rank(self, generate: Callable[[], _Result]) -> _Result:
        """Under torchrun every rank calls generate: rank 0 runs it while the others serve its steps; then every
        rank returns rank 0's outputs (or raises its error). Elsewhere it is generate()."""
        if not self.tp.torchrun:
            return generate()
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
        # The model (its decode graphs) first: NCCL (2.26 on) destroys a communicator only once no CUDA graph that
        # captured its collectives lives, and would wait for them for ever.
        self.model_runner.close()
        self.tp.close()

    def _check_stop(self, seq: Sequence) -> None:
        """vLLM's order: nothing stops before min_tokens; then EOS, stop token, stop string, length."""
        token, num_tokens = seq.token_ids[-1], len(seq.token_ids) - seq.num_prompt_tokens
        reached_min = num_tokens >= seq.params.min_tokens
        stop_string = self._update_text(seq, reached_min) if seq.params.stop_strings else None
        if not reached_min:
            return
        if token in seq.stop_token_ids:
            seq.finish_reason = "stop"
            if token not in seq.eos_token_ids:
                seq.stop_reason = token
        elif stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif num_tokens >= seq.max_tokens:
            seq.finish_reason = "length"

    @staticmethod
    def _check_grammar(seq: Sequence) -> None:
        """Follow the new token in the sequence's grammar. When nothing may be sampled next (no token continues the
        match and EOS is withheld by min_tokens or ignore_eos), the sequence stops (finish_reason "stop") rather than
        sample from all -inf; so does one whose token left the grammar (other constraints, allowed_token_ids or
        bad_words, had masked every token it allows)."""
        state = seq.grammar_state
        state.update(seq.token_ids, seq.num_prompt_tokens)
        if state.exhausted(bool(seq.eos_token_ids) and seq.num_completion_tokens >= seq.params.min_tokens):
            seq.finish_reason = "stop"

    def _update_text(self, seq: Sequence, search: bool) -> str | None:
        """Decode the new tokens; if a stop string ends in the new text, cut the text there and return it."""
        seen = len(seq.text)
        text = self._decode(seq)
        if not search:
            return None
        hits = [(i, s) for s in seq.params.stop_strings if (i := text.find(s, max(0, seen - len(s) + 1))) >= 0]
        if not hits:
            return None
        i, stop = min(hits)
        seq.detokenizer.truncate(i + len(stop) if seq.params.include_stop_str_in_output else i,
                                 seq.num_completion_tokens)
        return stop

    def _decode(self, seq: Sequence) -> str:
        """The completion's text, decoding only the tokens added since the last call; complete once finished."""
        if self.tokenizer is None or not seq.params.detokenize:
            return ""
        return seq.detokenizer.update(self.tokenizer, seq.token_ids, final=seq.is_finished)

    def _record_logprobs(self, batch: ScheduledBatch, result: RunnerOutput) -> None:
        if result.logprobs is None and result.prompt_logprobs is None:
            return
        for i, seq in enumerate(batch.seqs):
            if seq.is_finished:  # while this step was in flight (async scheduling): its outputs are out
                continue
            if result.logprobs is not None and result.logprobs[i] is not None:
                seq.logprobs.append(self._logprob_dict(result.logprobs[i], seq.params.logprobs,
                                                       seq.params.detokenize))
                seq.cumulative_logprob += result.logprobs[i][1][0]
            rows = result.prompt_logprobs[i] if result.prompt_logprobs is not None else None
            # A recomputed prompt (after preemption) yields positions already recorded: keep the first ones.
            for pos, row in enumerate(rows or [], start=batch.starts[i] + 1):
                if pos == len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append(self._logprob_dict(row, seq.params.prompt_logprobs,
                                                                  seq.params.detokenize))

    def _logprob_dict(self, row: TokenLogprobs, k: int, detokenize: bool) -> dict[int, Logprob]:
        """The chosen token's and the top k's logprobs and ranks, each token decoded unless detokenize is False."""
        out: dict[int, Logprob] = {}
        decode = detokenize and self.tokenizer is not None
        for t, lp, r in zip(*(x[:k + 1] for x in row)):  # the chosen token, then this request's top k
            if t not in out:
                out[t] = Logprob(lp, r, self._token_text(t) if decode else None)
        return out

    def _token_text(self, token_id: int) -> str:
        """A token decoded alone (a logprob's decoded_token), cached: a position's top k repeat across positions,
        and logprobs=-1 decodes the whole vocabulary at every one."""
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _output(self, request_id: str) -> RequestOutput | None:
        seqs = self.requests[request_id]
        first = seqs[0]
        kind = first.params.output_kind
        finished = seqs[-1].is_finished and all(s.is_finished for s in seqs)  # mostly decided by the first test
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if finished:
            del self.requests[request_id]
            first.metrics.finished_time = time.time()
        delta = kind is RequestOutputKind.DELTA
        return RequestOutput(request_id, first.prompt, first.prompt_token_ids, first.prompt_logprobs,
                             [self._completion(s, delta) for s in seqs], finished,
                             first.metrics, sum(s.num_cached_tokens for s in seqs))

    def _completion(self, seq: Sequence, delta: bool) -> CompletionOutput:
        text = self._decode(seq)
        logprobs = seq.logprobs
        if delta:  # only what is new since the previous output
            tokens_before, chars_before = seq.num_emitted_tokens, seq.num_emitted_chars
            seq.num_emitted_tokens, seq.num_emitted_chars = seq.num_completion_tokens, len(text)
            token_ids, text = seq.token_ids[seq.num_prompt_tokens + tokens_before:], text[chars_before:]
            logprobs = None if logprobs is None else logprobs[tokens_before:]
        else:
            token_ids = seq.completion_token_ids
        cumulative = seq.cumulative_logprob if seq.logprobs is not None else None
        return CompletionOutput(seq.index, text, token_ids, cumulative, logprobs, seq.finish_reason, seq.stop_reason)


_BYTES = (bytes, bytearray, memoryview)  # sequences of ints, but never token ids


def _token_ids(name: str, value: object) -> list[int]:
    if isinstance(value, (str, *_BYTES)) or not isinstance(value, SequenceABC):
        raise TypeError(f"{name} must be a list of ints, got {type(value).__name__}")
    bad = [t for t in value if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        raise TypeError(f"token ids must be ints, got {bad[0]!r}")
    return list(value)


def _request_id_list(request_ids: object) -> set[str]:
    if isinstance(request_ids, str):
        return {request_ids}
    if not isinstance(request_ids, Iterable):
        raise TypeError(f"request_ids must be a str or an iterable of strs, got {request_ids!r}")
    ids = list(request_ids)
    bad = [r for r in ids if not isinstance(r, str)]
    if bad:
        raise TypeError(f"request ids must be strs, got {bad[0]!r}")
    return set(ids)


def _whole_vocabulary_logprobs(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """params with logprobs or prompt_logprobs -1 (vLLM's "the whole vocabulary") as the vocabulary size."""
    if params.logprobs != -1 and params.prompt_logprobs != -1:
        return params
    return dataclasses.replace(params, **{name: vocab_size for name in ("logprobs", "prompt_logprobs")
                                          if getattr(params, name) == -1})


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of a seeded request draws from seed + index (as vLLM does): distinct but reproducible."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**64)


def _load_tokenizer(config: Config) -> PreTrainedTokenizerBase | None:
    """The `tokenizer` folder's if given, else the GGUF file's or the model folder's (None if it has none)."""
    if config.tokenizer_path is None and config.gguf_path is not None:
        return load_gguf_tokenizer(config.gguf_path)
    folder = config.tokenizer_path or config.model_path
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=config.trust_remote_code)
    except Exception as e:  # transformers' own: a tokenizer class shipped as code, without trust_remote_code, ...
        raise ValueError(f"cannot load the tokenizer in {folder}: {e}") from e


def _activation(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's for classifiers: a sigmoid of a single label's logit, else a softmax over the labels."""
    return logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)


def _sampleable_eos_token_ids(config: Config, vocab_size: int) -> set[int]:
    """The config's EOS ids inside the vocabulary. One outside (a default kept beside a smaller vocabulary) is never
    sampled; withheld by min_tokens it would index past the logits, a device assert on CUDA: left out, with a
    warning."""
    inside = {t for t in config.eos_token_ids if 0 <= t < vocab_size}
    if outside := sorted(set(config.eos_token_ids) - inside):
        logger.warning("EOS token ids %s of %s are outside the vocabulary [0, %d): ignored", outside,
                       config.model_path, vocab_size)
    return inside


def _own_copy(params: SamplingParams) -> SamplingParams:
    """A request's own copy of its params and of their lists and dicts: the engine reads them as long as the request
    runs (ban lists, allowed ids and biases go to the device), and ones the caller changed after submitting them
    would arrive unchecked (out-of-range ids: a device assert on CUDA). vLLM clones them too."""
    return dataclasses.replace(params, **{f.name: copy.copy(value) for f in dataclasses.fields(params)
                                          if f.init and isinstance(value := getattr(params, f.name), (list, dict))})
