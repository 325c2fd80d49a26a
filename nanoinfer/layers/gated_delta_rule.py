"""Gated DeltaNet's token mixing (causal depthwise conv + gated delta rule) over per-sequence recurrent state slots:
the chunked form for prompt chunks, the recurrent form for one-token steps batched over sequences."""
import torch
import torch.nn.functional as F

from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: q, k [B, H, dk], v [B, H, dv], log-decay g and beta [B, H], state
    [B, H, dk, dv] (updated in place) -> output [B, H, dv]. The state S maps keys to values: it decays by e^g,
    then moves its prediction for k towards v by beta (the delta rule); the output reads it with q."""
    state.mul_(g.exp()[..., None, None])
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)
    state.add_(k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - predicted)).unsqueeze(-2))
    return (q.unsqueeze(-2) @ state).squeeze(-2)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence over the n tokens of one sequence, a chunk of tokens at a time: q, k [n, H, dk],
    v [n, H, dv], g and beta [n, H], state [H, dk, dv] -> (output [n, H, dv], final state).

    Within a chunk, with G_t the cumulative log-decay from the chunk's start and S0 the state before it, the
    values each token writes, U = (I + L)^-1 (beta V - beta e^G K S0) with L_tj = beta_t e^(G_t - G_j) k_t.k_j for
    j < t, come from one triangular solve; outputs and the chunk's final state are then matmuls, and only the
    loop over chunks is sequential."""
    n = q.shape[0]
    pad = -n % chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [n, H, ...] -> [H, chunks, chunk_size, ...], zero padded
        x = x.movedim(0, 1)
        return F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad)).unflatten(1, (-1, chunk_size))

    q, k, v, g, beta = map(chunked, (q, k, v, g, beta))  # padding: g = beta = 0, k = 0 leaves the state alone
    cum = g.cumsum(-1)  # [H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # e^(G_t - G_j), j <= t
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle is L; the solve takes the diagonal as 1
    writes_v = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    writes_s0 = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False,
                                              unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_from_start = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(writes_v)
    for i in range(q.shape[1]):
        u = writes_v[:, i] - writes_s0[:, i] @ state
        out[:, i] = q_from_start[:, i] @ state + scores[:, i] @ u
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.flatten(1, 2)[:, :n].movedim(1, 0), state


class GatedDeltaRule(RecurrentLayer):
    """Gated DeltaNet's token mixing over its conv state and delta-rule state [H, dk, dv] per sequence, for the heads
    it is given (a tensor-parallel rank's)."""

    def __init__(self, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel_size: int):
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        super().__init__(conv_kernel_size, 2 * key_dim + value_dim, (num_v_heads, head_k_dim, head_v_dim))
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = (
            num_k_heads, num_v_heads, head_k_dim, head_v_dim)
        self.key_dim, self.value_dim = key_dim, value_dim

    def forward(self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                batch: RecurrentBatch) -> torch.Tensor:
        """mixed_qkv [tokens, 2 * key_dim + value_dim] (queries, keys, values of its heads), conv_weight
        [conv_dim, K], log-decay g and beta [tokens, value heads] -> output [tokens, value heads, dv] in the
        state's dtype."""
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
        return self._delta_rule(q, k, v, g.to(dtype), beta.to(dtype), batch)

    def _delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    batch: RecurrentBatch) -> torch.Tensor:
        out = torch.empty_like(v)
        if batch.single_rows.numel():
            rows, slots = batch.single_rows, batch.single_slots
            state = self.ssm_state[slots]
            out[rows] = recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
            self.ssm_state[slots] = state
        for start, end, slot in batch.spans:
            s = slice(start, end)
            out[s], self.ssm_state[slot] = chunk_gated_delta_rule(q[s], k[s], v[s], g[s], beta[s], self.ssm_state[slot])
        return out
