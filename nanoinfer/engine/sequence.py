"""A request's token ids and its progress through prefill, decode and the KV cache."""
from enum import Enum, auto
from itertools import count

import torch

from nanoinfer.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    ids = count()  # request ids, shared with embedding requests

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int, prompt: str | None = None):
        self.seq_id = next(Sequence.ids)
        self.status = SequenceStatus.WAITING
        self.prompt = prompt
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.state_slot = -1  # recurrent-state slot while it holds blocks (models with linear attention)
        self.finish_reason: str | None = None
        # A private generator makes seeded sampling independent of what else is in the batch.
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

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
