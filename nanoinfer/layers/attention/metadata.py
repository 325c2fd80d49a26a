"""What every attention backend needs to know about one step's batch, built once by the ModelRunner."""
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [num_tokens] int64: cache slot (block * block_size + offset) of each new
    # token; None: nothing is cached (a bidirectional encoder pass over whole sequences)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 padded: the KV blocks of each sequence
    context_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache once this step's tokens are stored
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's new tokens
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's whole context
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    has_cached_prefix: bool = False  # some sequence attends to keys stored in earlier steps (a prefill detail)
    # False: every token of a sequence attends to all of it (but an encoder's local layer: its window on both sides)
    causal: bool = True
    # [num_seqs] int64: each sequence's recurrent-state slot; only for models with linear-attention layers.
    state_slots: torch.Tensor | None = None
    backend_state: Any = None  # whatever the chosen backend derives from the above, once per step
    model_state: Any = None  # whatever the model's layers derive from the above, once per step (MLA's split: mla.py)
    # The same step as built on the host, where these tensors were copied to a device: what a layer reads values of
    # on the host comes from there, not back from the device (a sync that waits for the queued work). None: these.
    host: "AttentionMetadata | None" = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1 and self.causal

    def context_slots(self, seq: int, context: int) -> torch.Tensor:
        """The cache slots of sequence `seq`'s first `context` tokens, in order (for layers that read a context back
        from the cache themselves: DeepSeek's sparse attention, Inkling's relative logits)."""
        blocks = self.block_tables[seq, :-(-context // self.block_size)].long()
        offsets = torch.arange(self.block_size, device=blocks.device)
        return (blocks.unsqueeze(1) * self.block_size + offsets).flatten()[:context]

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The same metadata with its tensors on `device` (built on the CPU, then copied once per step)."""
        if self.context_lens.device == device:
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return replace(self, slot_mapping=move(self.slot_mapping), block_tables=move(self.block_tables),
                       context_lens=move(self.context_lens), cu_seqlens_q=move(self.cu_seqlens_q),
                       cu_seqlens_k=move(self.cu_seqlens_k), host=self)

    @property
    def on_host(self) -> "AttentionMetadata":
        """This step's metadata with host tensors (itself if its tensors are on the host)."""
        return self if self.host is None else self.host
