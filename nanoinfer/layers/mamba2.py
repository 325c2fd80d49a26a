"""The Mamba2 mixer (Bamba, Granite 4.0-H): in_proj -> (z, xBC, dt); a causal conv over xBC carried in a per-sequence
conv state; the SSD scan over a per-sequence state [heads, head_dim, d_state], chunked for prompt chunks and one
step at a time for decode; a gated group RMSNorm; out_proj. In fp32 it computes what transformers' torch path does."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """x [..., T] -> [..., T, T]: entry (i, j) is x[j+1] + ... + x[i] for j <= i, -inf above the diagonal; summed by
    a masked cumsum, not as a difference of cumsums (transformers' form: stable, and rounded the same)."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    below = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-1)
    x = x.masked_fill(~below, 0).cumsum(-2)
    return x.masked_fill(~below.logical_or(torch.eye(t, dtype=torch.bool, device=x.device)), -torch.inf)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n tokens of one sequence: x [n, H, P], dt [n, H] (after softplus and clamp), A [H] (negative), B, C
    [n, G, N] (each group serves H / G consecutive heads), D [H], state [H, P, N] before the first token, all in one
    float dtype -> (y [n, H, P], the state after the last token).

    With state S_t = e^(dt_t A) S_(t-1) + dt_t x_t B_t^T and y_t = S_t C_t + D x_t: within a chunk the outputs are a
    decay-masked attention (C.B) over dt x; chunk end states are sums over the chunk; the states entering each chunk
    come from one decay matrix over chunks. Zero padding (dt = 0) neither decays nor writes."""
    n, heads, _ = x.shape
    B = B.repeat_interleave(heads // B.shape[1], 1)
    C = C.repeat_interleave(heads // C.shape[1], 1)
    y_skip = D[:, None] * x
    pad = -n % chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [chunks, chunk_size, ...], zero padded
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).unflatten(0, (-1, chunk_size))

    x, A, B, C = map(chunked, (x * dt[..., None], A * dt, B, C))  # x [c, l, h, p], A [c, l, h], B, C [c, l, h, n]
    A = A.permute(2, 0, 1)  # [h, c, l]
    A_cumsum = A.cumsum(-1)
    # Within chunks: y_l = sum_(s <= l) e^(A_l + ... + A_(s+1)) (C_l . B_s) x_s.
    decay = segment_sum(A).exp()  # [h, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x)
    # Each chunk's own contribution to the state at its end.
    to_end = (A_cumsum[..., -1:] - A_cumsum).exp()  # [h, c, l]
    chunk_states = torch.einsum("clhn,clhp->chpn", B * to_end.permute(1, 2, 0)[..., None], x)
    # The states entering each chunk (and the final one): the carried-in state and every earlier chunk's, decayed.
    chunk_states = torch.cat((state[None], chunk_states))
    across = segment_sum(F.pad(A_cumsum[..., -1], (1, 0))).exp().permute(2, 1, 0)  # [from chunk, to chunk, h]
    states = torch.einsum("zch,zhpn->chpn", across, chunk_states)
    states, final = states[:-1], states[-1]
    y_off = torch.einsum("clhn,chpn->clhp", C, states) * A_cumsum.exp().permute(1, 2, 0)[..., None]
    return (y_diag + y_off).flatten(0, 1)[:n] + y_skip, final


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
             state: torch.Tensor) -> torch.Tensor:
    """One token of each of S sequences: x [S, H, P], dt [S, H], B, C [S, G, N], state [S, H, P, N] (updated in
    place) -> y [S, H, P]."""
    heads = x.shape[1]
    B = B.repeat_interleave(heads // B.shape[1], 1)
    C = C.repeat_interleave(heads // C.shape[1], 1)
    state.mul_((dt * A).exp()[..., None, None]).add_((dt[..., None] * x)[..., None] * B[:, :, None, :])
    return (state @ C[..., None]).squeeze(-1) + D[:, None] * x


class Mamba2GatedRMSNorm(nn.Module):
    """RMSNorm(y * silu(z)) over groups of channels (norm_before_gate=False), weight applied after the cast back."""

    def __init__(self, hidden_size: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = (y.float() * F.silu(gate.float())).unflatten(-1, (-1, self.group_size))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * h.to(y.dtype)


class Mamba2Mixer(RecurrentLayer):
    """The mixer of one layer, from the config's mamba_* settings. Its projections are replicated, not sharded:
    under tensor parallelism every rank computes the whole layer with its own state (correct, not yet faster)."""

    def __init__(self, config: PretrainedConfig):
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for the Mamba2 conv; only 'silu' is "
                             f"implemented")
        heads, head_dim, groups = config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups
        intermediate_size = int(config.mamba_expand * config.hidden_size)
        if heads % groups or heads * head_dim != intermediate_size:
            raise ValueError(f"mamba_n_heads={heads} x mamba_d_head={head_dim} must be mamba_expand x hidden_size="
                             f"{intermediate_size}, in mamba_n_groups={groups} equal groups")
        conv_dim = intermediate_size + 2 * groups * config.mamba_d_state
        super().__init__(config.mamba_d_conv, conv_dim, (heads, head_dim, config.mamba_d_state))
        self.num_heads, self.head_dim, self.n_groups, self.state_size = heads, head_dim, groups, config.mamba_d_state
        self.intermediate_size, self.conv_dim = intermediate_size, conv_dim
        self.chunk_size = config.mamba_chunk_size
        self.time_step_limit = tuple(config.time_step_limit or (0.0, float("inf")))
        self.in_proj = ReplicatedLinear(config.hidden_size, self.intermediate_size + conv_dim + self.num_heads,
                                        config.mamba_proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.mamba_d_conv, bias=config.mamba_conv_bias,
                                groups=conv_dim)  # a weight holder: the conv runs in RecurrentLayer.causal_conv
        self.conv1d.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.norm = Mamba2GatedRMSNorm(self.intermediate_size, self.intermediate_size // self.n_groups,
                                       config.rms_norm_eps)
        self.out_proj = ReplicatedLinear(self.intermediate_size, config.hidden_size, config.mamba_proj_bias)

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        n, groups = x.shape[0], self.n_groups * self.state_size
        z, xbc, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, self.num_heads], -1)
        xbc = self.causal_conv(xbc, self.conv1d.weight.squeeze(1), batch, self.conv1d.bias)
        dtype = self.ssm_state.dtype
        xs, B, C = xbc.to(dtype).split([self.intermediate_size, groups, groups], -1)
        dt = F.softplus(dt.to(dtype) + self.dt_bias.to(dtype)).clamp(*self.time_step_limit)
        y = self._scan(xs.view(n, self.num_heads, self.head_dim), dt, B.view(n, self.n_groups, self.state_size),
                       C.view(n, self.n_groups, self.state_size), batch)
        return self.out_proj(self.norm(y.flatten(1), z).to(x.dtype))

    def _scan(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, batch: RecurrentBatch
              ) -> torch.Tensor:
        A, D = -self.A_log.to(x.dtype).exp(), self.D.to(x.dtype)
        out = torch.empty_like(x)
        if batch.single_rows.numel():
            rows, slots = batch.single_rows, batch.single_slots
            state = self.ssm_state[slots]
            out[rows] = ssd_step(x[rows], dt[rows], A, B[rows], C[rows], D, state)
            self.ssm_state[slots] = state
        for start, end, slot in batch.spans:
            s = slice(start, end)
            out[s], self.ssm_state[slot] = ssd_chunk_scan(x[s], dt[s], A, B[s], C[s], D, self.ssm_state[slot],
                                                          self.chunk_size)
        return out
