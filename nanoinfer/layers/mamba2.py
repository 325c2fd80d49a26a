"""The Mamba2 mixer (Bamba, Granite 4.0-H, NemotronH, Falcon-H1): in_proj -> (z, xBC, dt); a causal conv over xBC
carried in a per-sequence conv state; the SSD scan over a per-sequence state [heads, head_dim, d_state], chunked for
prompt chunks and one step at a time for decode; a gated group RMSNorm (or the gate alone); out_proj. In fp32 it
computes what transformers' torch path does. Under tensor parallelism each rank holds its heads (as vLLM's
MambaMixer2)."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.linear import RowParallelLinear, SegmentedColumnParallelLinear, local_rows
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer, RowShardedWeight, load_rank_rows
from nanoinfer.utils.dist import tp_group, tp_rank, tp_size


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


@dataclass(frozen=True)
class Mamba2Settings:
    """A Mamba2 mixer's shape and options, which each family reads from its config under its own names."""
    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    eps: float  # the gated norm's
    conv_bias: bool
    in_proj_bias: bool
    out_proj_bias: bool
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    activation: str = "silu"  # the conv's
    gated_norm: bool = True  # False: y * silu(z) alone (Falcon-H1 without `mamba_rms_norm`)
    norm_before_gate: bool = False  # True: RMSNorm(y) * silu(z) (Falcon-H1's option)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim


class Mamba2GatedRMSNorm(nn.Module):
    """RMSNorm(y * silu(z)) over groups of channels, weight applied after the cast back; norm_before_gate:
    RMSNorm(y) * silu(z). Holds this rank's channels; groups that do not split over the ranks (vLLM's n_groups = 1
    case, or any other count) are normed over all their channels: their partial sums of squares are all-reduced."""

    def __init__(self, hidden_size: int, n_groups: int, eps: float, norm_before_gate: bool = False):
        super().__init__()
        channels = hidden_size // tp_size()
        self.weight = nn.Parameter(torch.ones(channels), requires_grad=False)
        self.n_groups, self.group_size, self.eps, self.norm_before_gate = (n_groups, hidden_size // n_groups, eps,
                                                                           norm_before_gate)
        self.tp_group = tp_group()
        spread = n_groups % tp_size() != 0
        self.register_buffer("channel_groups", (tp_rank() * channels + torch.arange(channels)) // self.group_size
                             if spread else None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_rank_rows(param, loaded)

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gate = F.silu(gate.float())
        h = y.float() if self.norm_before_gate else y.float() * gate
        if self.channel_groups is None:
            h = h.unflatten(-1, (-1, self.group_size))
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        else:
            h = h * torch.rsqrt(self._spread_mean_squares(h) + self.eps)
        h = self.weight * h.to(y.dtype)
        return h * gate if self.norm_before_gate else h

    def _spread_mean_squares(self, h: torch.Tensor) -> torch.Tensor:
        """h [tokens, channels] -> each channel's group's mean square, summed over the ranks holding the group."""
        sums = h.new_zeros(h.shape[0], self.n_groups).index_add_(1, self.channel_groups, h.pow(2))
        dist.all_reduce(sums, group=self.tp_group)
        return (sums / self.group_size)[:, self.channel_groups]


def silu_gate(y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gate without a norm: y * silu(z)."""
    return y.float() * F.silu(gate.float())


class Mamba2Mixer(RecurrentLayer):
    """The mixer of one layer. Under tensor parallelism each rank holds its heads: their z, x and dt rows of in_proj,
    x's conv channels, A_log, D, dt_bias, their state and norm channels, out_proj's input columns (all-reduced). The
    groups of B and C split when the ranks divide them; else every rank keeps (and convolves) all of them and picks
    its heads' ones, as vLLM does. num_heads, intermediate_size, n_groups and conv_dim are this rank's."""

    def __init__(self, settings: Mamba2Settings):
        s, tp = settings, tp_size()
        if s.activation != "silu":
            raise ValueError(f"unsupported activation {s.activation!r} for the Mamba2 conv; only 'silu' is implemented")
        if s.num_heads % s.n_groups:
            raise ValueError(f"{s.num_heads} Mamba2 heads cannot form {s.n_groups} equal groups")
        if s.num_heads % tp:
            raise ValueError(f"{s.num_heads} Mamba2 heads do not split over tensor_parallel_size={tp}")
        split_groups = s.n_groups % tp == 0
        groups = s.n_groups * s.state_size
        xbc = [(s.intermediate_size, True), (groups, split_groups), (groups, split_groups)]
        conv_dim, heads = local_rows(xbc), s.num_heads // tp
        super().__init__(s.conv_kernel, conv_dim, (heads, s.head_dim, s.state_size))
        self.num_heads, self.head_dim, self.state_size = heads, s.head_dim, s.state_size
        self.n_groups = s.n_groups // tp if split_groups else s.n_groups
        self.intermediate_size, self.conv_dim = self.num_heads * s.head_dim, conv_dim
        self.chunk_size = s.chunk_size
        self.time_step_limit = s.time_step_limit
        self.in_proj = SegmentedColumnParallelLinear(s.hidden_size, [(s.intermediate_size, True), *xbc,
                                                                     (s.num_heads, True)], s.in_proj_bias)
        # A weight holder: the conv runs in RecurrentLayer.causal_conv.
        self.conv1d = RowShardedWeight(xbc, (1, s.conv_kernel), s.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.norm = (Mamba2GatedRMSNorm(s.intermediate_size, s.n_groups, s.eps, s.norm_before_gate)
                     if s.gated_norm else silu_gate)
        self.out_proj = RowParallelLinear(s.intermediate_size, s.hidden_size, s.out_proj_bias)
        # With every group on every rank: the group of each of this rank's heads (None: the groups split as the heads).
        heads_per_group = s.num_heads // s.n_groups
        self.register_buffer("head_groups", None if split_groups else
                             (tp_rank() * self.num_heads + torch.arange(self.num_heads)) // heads_per_group,
                             persistent=False)

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        n, groups = x.shape[0], self.n_groups * self.state_size
        z, xbc, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, self.num_heads], -1)
        xbc = self.causal_conv(xbc, self.conv1d.weight.squeeze(1), batch, self.conv1d.bias)
        dtype = self.ssm_state.dtype
        xs, B, C = xbc.to(dtype).split([self.intermediate_size, groups, groups], -1)
        dt = F.softplus(dt.to(dtype) + self.dt_bias.to(dtype))
        B, C = B.view(n, self.n_groups, self.state_size), C.view(n, self.n_groups, self.state_size)
        if self.head_groups is not None:  # one group per head, each its own
            B, C = B[:, self.head_groups], C[:, self.head_groups]
        y = self._scan(xs.view(n, self.num_heads, self.head_dim), dt, B, C, batch)
        return self.out_proj(self.norm(y.flatten(1), z).to(x.dtype))

    def _scan(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, batch: RecurrentBatch
              ) -> torch.Tensor:
        A, D = -self.A_log.to(x.dtype).exp(), self.D.to(x.dtype)
        # time_step_limit clamps dt in the chunked form only, as transformers and mamba_ssm do (their one-step
        # forms take it unclamped); it binds where softplus falls below a floor (NemotronH's, Zamba2's).
        return self.scan(batch, lambda x, dt, B, C, state: ssd_step(x, dt, A, B, C, D, state),
                         lambda x, dt, B, C, state: ssd_chunk_scan(x, dt.clamp(*self.time_step_limit), A, B, C, D,
                                                                   state, self.chunk_size),
                         x, dt, B, C)
