"""Turns last-position logits into next tokens: penalties, min_tokens, greedy, temperature, min_p, top-k and
top-p (vLLM's order and definitions), per-request seeds, and the top-k logprobs of the raw distribution."""
from dataclasses import dataclass

import torch
from torch import nn

from nanoinfer.kernels import cpu as cpu_kernels


@dataclass
class Penalties:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties of some rows."""
    rows: torch.Tensor  # [R] batch rows these apply to
    repetition: torch.Tensor  # [R]
    presence: torch.Tensor  # [R]
    frequency: torch.Tensor  # [R]
    prompt_mask: torch.Tensor  # [R, V] bool: the token occurs in the prompt
    output_counts: torch.Tensor  # [R, V] float: how often the token was generated


@dataclass
class SamplingMetadata:
    temperatures: torch.Tensor  # [B]; 0 means greedy
    top_k: torch.Tensor  # [B]; <= 0 or >= V disables
    top_p: torch.Tensor  # [B]; 1 disables
    generators: list[torch.Generator | None]
    default_generator: torch.Generator
    min_p: torch.Tensor | None = None  # [B]; None when no row uses it
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) not allowed yet (min_tokens)
    num_logprobs: int | None = None  # the most top logprobs any row asks for; None: no logprobs

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperatures == 0).all())


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    # With logprobs, over the raw (unprocessed) distribution: the chosen token's logprob and rank, and the
    # top num_logprobs tokens with their logprobs.
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] fp32."""
        raw = logits
        logits = self.penalize(logits, m)
        tokens = cpu_kernels.argmax(logits) if cpu_kernels.use_cpu_kernels(logits) else logits.argmax(-1)
        if not m.all_greedy:
            probs = torch.softmax(self.warp(logits, m), -1)
            # Exponential race (argmax p / E, E ~ Exp(1)) draws from probs; the noise of a seeded request comes
            # from its own generator, so its tokens do not depend on the rest of the batch.
            noise = torch.empty_like(probs).exponential_(generator=m.default_generator)
            for i, g in enumerate(m.generators):
                if g is not None:
                    noise[i].exponential_(generator=g)
            noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a zero would turn a filtered token's 0 / 0 into NaN
            tokens = torch.where(m.temperatures == 0, tokens, (probs / noise).argmax(-1))
        if m.num_logprobs is None:
            return SamplerOutput(tokens)
        return SamplerOutput(tokens, top_logprobs(raw, tokens, m.num_logprobs))

    @staticmethod
    def penalize(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        """What greedy rows take the argmax of: min_tokens bans, then repetition, frequency, presence penalties."""
        if m.banned is None and m.penalties is None:
            return logits
        logits = logits.clone()
        if m.banned is not None:
            logits[m.banned] = float("-inf")
        if (p := m.penalties) is not None:
            rows = logits[p.rows]
            seen = p.prompt_mask | (p.output_counts > 0)
            rep = p.repetition.unsqueeze(1)
            rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
            rows -= p.frequency.unsqueeze(1) * p.output_counts + p.presence.unsqueeze(1) * (p.output_counts > 0)
            logits[p.rows] = rows
        return logits

    @staticmethod
    def warp(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        """Temperature, then min_p, then top-k and top-p: softmax of the result is what a sampled row draws from."""
        logits = logits / m.temperatures.clamp_min(1e-6).unsqueeze(1)
        if m.min_p is not None:
            probs = logits.softmax(-1)
            drop = probs < m.min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)
            logits = logits.masked_fill(drop, float("-inf"))
        return _filter_top_k_top_p(logits, m.top_k, m.top_p)

    def processed_logits(self, logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        return self.warp(self.penalize(logits, m), m)


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax(logits) at token_ids [B], their ranks (1 = most likely), and the top-k ids and logprobs."""
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))
    ranks = (logprobs >= chosen).sum(-1)
    top = logprobs.topk(k, -1)
    return chosen.squeeze(-1), ranks, top.indices, top.values


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if not bool(use_k.any() or use_p.any()):
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    rank = torch.arange(vocab)
    drop = use_k.unsqueeze(1) & (rank >= top_k.unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # Drop a token once the tokens ranked above it already reach top_p; the first token always stays.
    drop = use_p.unsqueeze(1) & (probs.cumsum(-1) - probs >= top_p.unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
