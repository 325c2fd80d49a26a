"""Gated linear attention over per-sequence recurrent state slots: the gated delta rule (Gated DeltaNet's, whose
decay is one gate per head; Kimi Delta Attention's, one per key channel) and, without the delta rule, decayed linear
attention (MiniMax's lightning attention). The chunked form runs prompt chunks, the recurrent form one-token steps
batched over sequences; GatedDeltaRule adds the causal depthwise conv and q/k normalization Gated DeltaNet and KDA
share."""
import torch
import torch.nn.functional as F

from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer

# Tokens per chunk of the chunked form. A decay per head makes a chunk's products matmuls, fastest at 64; one per key
# channel (KDA's) takes [H, C, C, dk] elementwise per product, C^2 a chunk, C per token: 8 measured 10-28x faster than
# 64 on 2k-token prompts at 4-16 heads (fp32, one thread).
HEAD_DECAY_CHUNK, CHANNEL_DECAY_CHUNK = 64, 8


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def per_channel(g: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A log-decay of one gate per head [..., H] as [..., H, 1]; one per key channel [..., H, dk] as is."""
    return g if g.dim() == k.dim() else g.unsqueeze(-1)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor | None, state: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: q, k [B, H, dk], v [B, H, dv], log-decay g [B, H] (per head) or [B, H, dk]
    (per key channel), beta [B, H], state [B, H, dk, dv] (updated in place) -> output [B, H, dv]. The state S maps
    keys to values: it decays by e^g, then moves its prediction for k towards v by beta (the delta rule; beta None:
    adds k v^T, plain linear attention); the output reads it with q."""
    state.mul_(per_channel(g, k).exp().unsqueeze(-1))
    write = v if beta is None else beta.unsqueeze(-1) * (v - (k.unsqueeze(-2) @ state).squeeze(-2))
    state.add_(k.unsqueeze(-1) * write.unsqueeze(-2))
    return (q.unsqueeze(-2) @ state).squeeze(-2)


def _decayed_products(a: torch.Tensor, b: torch.Tensor, cum: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """Within a chunk, sum_c a_tc b_jc e^(G_tc - G_jc) for j <= t, 0 above: a, b [H, C, dk], cumulative log-decay cum
    [H, C, 1] (one gate per head: a matmul, then the decay) or [H, C, dk] (per channel: the decay inside the sum,
    [H, C, C, dk] at once; e^G_t and e^-G_j apart would overflow where decays are strong)."""
    decay = (cum.unsqueeze(-2) - cum.unsqueeze(-3)).masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()
    if cum.shape[-1] == 1:
        return (a @ b.transpose(-1, -2)) * decay.squeeze(-1)
    return (a.unsqueeze(-2) * b.unsqueeze(-3) * decay).sum(-1)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor | None, state: torch.Tensor, chunk_size: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence over the n tokens of one sequence, a chunk of tokens at a time: q, k [n, H, dk],
    v [n, H, dv], g [n, H] or [n, H, dk], beta [n, H] or None, state [H, dk, dv] -> (output [n, H, dv], final state).

    Within a chunk, with G_t the cumulative log-decay from the chunk's start and S0 the state before it, the
    values each token writes, U = (I + L)^-1 (beta V - beta e^G K S0) with L_tj = beta_t k_t.(e^(G_t - G_j) k_j)
    for j < t, come from one triangular solve (without the delta rule U = V); outputs and the chunk's final state are
    then matmuls. Chunk by chunk, so that per-channel decays take [H, C, C, dk] at a time, not per prompt; chunk_size
    None: HEAD_DECAY_CHUNK or CHANNEL_DECAY_CHUNK, as g has."""
    n = q.shape[0]
    chunk_size = chunk_size or (CHANNEL_DECAY_CHUNK if g.dim() == k.dim() else HEAD_DECAY_CHUNK)
    pad = -n % chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [n, H, ...] -> [H, chunks, chunk_size, ...], zero padded
        x = x.movedim(0, 1)
        return F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad)).unflatten(1, (-1, chunk_size))

    # Padding: g = beta = 0, k = 0 leaves the state alone.
    q, k, v, g = map(chunked, (q, k, v, per_channel(g, k)))
    beta = None if beta is None else chunked(beta).unsqueeze(-1)  # [H, N, C, 1]
    cum = g.cumsum(2)  # [H, N, C, 1 or dk]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        qi, ki, vi, ci = q[:, i], k[:, i], v[:, i], cum[:, i]
        if beta is None:
            u = vi
        else:
            k_beta = ki * beta[:, i]
            # The strict lower triangle is L; the solve takes the diagonal as 1.
            system = _decayed_products(k_beta, ki, ci, causal)
            u = torch.linalg.solve_triangular(system, vi * beta[:, i] - (k_beta * ci.exp()) @ state, upper=False,
                                              unitriangular=True)
        out[:, i] = (qi * ci.exp()) @ state + _decayed_products(qi, ki, ci, causal) @ u
        state = state * ci[:, -1].exp().unsqueeze(-1) + (ki * (ci[:, -1:] - ci).exp()).transpose(-1, -2) @ u
    return out.flatten(1, 2)[:, :n].movedim(1, 0), state


class GatedDeltaRule(RecurrentLayer):
    """Gated DeltaNet's and Kimi Delta Attention's token mixing over its conv state and delta-rule state
    [H, dk, dv] per sequence, for the heads it is given (a tensor-parallel rank's)."""

    def __init__(self, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel_size: int):
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        super().__init__(conv_kernel_size, 2 * key_dim + value_dim, (num_v_heads, head_k_dim, head_v_dim))
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = (
            num_k_heads, num_v_heads, head_k_dim, head_v_dim)
        self.key_dim, self.value_dim = key_dim, value_dim

    def forward(self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                batch: RecurrentBatch) -> torch.Tensor:
        """mixed_qkv [tokens, 2 * key_dim + value_dim] (queries, keys, values of its heads), conv_weight
        [conv_dim, K], log-decay g [tokens, value heads] (Gated DeltaNet) or [tokens, value heads, dk] (KDA) and
        beta [tokens, value heads] -> output [tokens, value heads, dv] in the state's dtype."""
        self.reset_fresh_slots(batch)
        mixed_qkv = self.causal_conv(mixed_qkv, conv_weight, batch)
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        n, group = q.shape[0], self.num_v_heads // self.num_k_heads
        dtype = self.ssm_state.dtype
        q = l2norm(q.reshape(n, self.num_k_heads, self.head_k_dim).to(dtype)) * self.head_k_dim ** -0.5
        k = l2norm(k.reshape(n, self.num_k_heads, self.head_k_dim).to(dtype))
        # Each query/key head serves `group` consecutive value heads.
        q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
        v = v.reshape(n, self.num_v_heads, self.head_v_dim).to(dtype)
        return self.scan(batch, recurrent_gated_delta_rule, chunk_gated_delta_rule, q, k, v, g.to(dtype),
                         beta.to(dtype))
