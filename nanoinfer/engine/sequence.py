"""A request's token ids and its progress through prefill, decode and the KV cache."""
from enum import Enum, auto
from itertools import count

import torch

from nanoinfer.engine.detokenizer import IncrementalDetokenizer
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import Logprob, RequestMetrics
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.structured.grammar import Grammar, GrammarState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


# Looked up once: an Enum member costs ~0.3 us on Python 3.11, and is_finished is asked per sequence per step.
_FINISHED = SequenceStatus.FINISHED


class Sequence:
    ids = count()  # request ids, shared with embedding requests

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int, prompt: str | None = None,
                 request_id: str = "", index: int = 0, max_tokens: int | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), metrics: RequestMetrics | None = None,
                 bad_words_token_ids: tuple[tuple[int, ...], ...] = (), grammar: Grammar | None = None,
                 lora_request: LoRARequest | None = None, priority: int = 0,
                 prompt_embeds: torch.Tensor | None = None):
        self.seq_id = next(Sequence.ids)
        self.priority = priority  # with scheduling_policy="priority": lower runs first, then earlier (seq_id)
        self.status = SequenceStatus.WAITING
        self.prompt = prompt
        self.token_ids = list(token_ids)
        # A prompt given as embeddings [prompt tokens, hidden] (LLM(enable_prompt_embeds=True)): the model takes them
        # in place of its token embeddings there, and token_ids holds placeholders that nothing reads.
        self.prompt_embeds = prompt_embeds
        # What every output of the request carries (one list for all); None for a prompt of embeddings.
        self.prompt_token_ids = self.token_ids[:] if prompt_embeds is None else None
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.request_id, self.index = request_id, index  # completion `index` of request `request_id`
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = self.eos_token_ids | frozenset(params.stop_token_ids)  # either ends it (as "stop")
        # params.bad_words as token sequences (the engine tokenizes them): each one's last token is banned where
        # the generated tokens end with the others.
        self.bad_words_token_ids = bad_words_token_ids
        # params.structured_outputs compiled (the engine does it): where the completion stands in it.
        self.grammar_state = None if grammar is None else GrammarState(grammar)
        # Whether the next token's distribution depends on the generated tokens as the host knows them: bad words of
        # several tokens (the generated tail), structured outputs (the grammar state). Such a sequence gets no drafts
        # (the verifier does not model per-draft state), and a step scheduled ahead of its pending token reads that
        # token before sampling (ModelRunner._pending_tokens). A one-token bad word is banned everywhere, penalties
        # count the sampled tokens on the device (see PenaltyCache), min_tokens bans by position.
        self.reads_history = grammar is not None or any(len(word) > 1 for word in bad_words_token_ids)
        self.metrics = metrics  # shared by the n completions of a request
        self.lora_request = lora_request  # kept through preemption: a recomputed sequence runs its adapter again
        self.lora_int_id = 0 if lora_request is None else lora_request.lora_int_id  # 0: no adapter
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache, or computed by a step in flight
        # Sampled by steps in flight, not yet appended to token_ids: one per such step, from schedule to postprocess
        # (a step scheduled ahead computes the one before it without knowing it: see Scheduler.schedule).
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.state_slot = -1  # recurrent-state slot while it holds blocks (models with linear attention)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # The decoded completion, cut at a stop string (kept up to date only when text is needed).
        self.detokenizer = IncrementalDetokenizer(params.skip_special_tokens, self.num_prompt_tokens)
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # Only the first completion computes the prompt's logprobs, so it alone skips the prefix cache.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.num_emitted_tokens = self.num_emitted_chars = 0  # what earlier DELTA outputs already carried
        # The key of this sequence's sampling noise, with the position (see sampler.noise_keys): an explicit seed
        # makes its tokens independent of what else is in the batch; None is drawn from the engine's seed.
        self.seed: int | None = None if params.seed is None else params.seed % 2**64

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt logprobs are still owed: then every prompt position is computed, none taken from the cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]
