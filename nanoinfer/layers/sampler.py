"""Turns last-position logits into next tokens: greedy, temperature, top-k and top-p, with per-request seeds."""
import torch
from torch import nn

from nanoinfer.kernels import cpu as cpu_kernels


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                generators: list[torch.Generator | None], default_generator: torch.Generator) -> torch.Tensor:
        """logits [B, V] fp32; temperature 0 means greedy; top_k <= 0 or >= V and top_p == 1 disable those filters."""
        greedy = cpu_kernels.argmax(logits) if cpu_kernels.use_cpu_kernels(logits) else logits.argmax(-1)
        if bool((temperatures == 0).all()):
            return greedy
        logits = logits / temperatures.clamp_min(1e-6).unsqueeze(1)
        probs = torch.softmax(_filter_top_k_top_p(logits, top_k, top_p), -1)
        # Exponential race (argmax p / E, E ~ Exp(1)) draws from probs; the noise of a seeded request comes
        # from its own generator, so its tokens do not depend on the rest of the batch.
        noise = torch.empty_like(probs).exponential_(generator=default_generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a zero would turn a filtered token's 0 / 0 into NaN
        sampled = (probs / noise).argmax(-1)
        return torch.where(temperatures == 0, greedy, sampled)


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
