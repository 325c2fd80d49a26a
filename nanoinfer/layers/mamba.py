"""The Mamba (1) mixer (Mamba, Falcon-Mamba, Jamba): in_proj -> (x, z); a causal conv over x carried in a per-sequence
conv state; x_proj -> (dt, B, C) (RMS-normed in Falcon-Mamba and Jamba); the selective scan over a per-sequence state
[intermediate, d_state], a prompt's chunks at a time (a parallel scan within them on GPUs), one step for decode;
D skip, y * silu(z); out_proj. In fp32 it computes what transformers' torch path (modeling_mamba.py) does. Under tensor
parallelism each rank holds its intermediate channels (as vLLM's MambaMixer). Zamba's multi-head variant
(MultiHeadMambaMixer) splits the channels into heads, each with its own x_proj and dt_proj."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.layernorm import RMSNorm, WeightlessRMSNorm
from nanoinfer.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer, RowShardedWeight
from nanoinfer.utils.dist import tp_size

# Tokens per scan chunk, whose intermediates are [chunk, intermediate, d_state] fp32: on CPUs, scanned token by token
# in chunks that stay in cache (16 x 1536 x 16: 1.5 MiB); on GPUs, by the parallel scan (Jamba: 64 x 8192 x 16, 32 MiB).
CPU_SCAN_CHUNK, GPU_SCAN_CHUNK = 16, 64


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, state: torch.Tensor, chunk_size: int | None = None, parallel: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The n tokens of one sequence: x, dt [n, I] (dt after softplus), A [I, N] (negative), B, C [n, N], D [I],
    state [I, N] before the first token, one float dtype -> (y [n, I] without the gate, the state after the last token).
    With heads (Zamba's), each its own B and C: x, dt [n, H, P], A [H, P, N], B, C [n, H, N], D [H, P], state [H, P, N].

    h_t = e^(dt_t A) h_(t-1) + dt_t B_t x_t and y_t = h_t C_t + D x_t: the decays and inputs of a chunk at once, then
    every h_t of the chunk (see scan_chunk; None: the parallel form and GPU_SCAN_CHUNK on GPUs), then the outputs at
    once; the state carries from chunk to chunk."""
    on_gpu = x.device.type != "cpu"
    chunk_size = chunk_size or (GPU_SCAN_CHUNK if on_gpu else CPU_SCAN_CHUNK)
    parallel = on_gpu if parallel is None else parallel
    ys = []
    for start in range(0, x.shape[0], chunk_size):
        s = slice(start, start + chunk_size)
        decay = (dt[s, ..., None] * A).exp()  # [l, I, N]
        h = dt[s, ..., None] * B[s, ..., None, :] * x[s, ..., None]  # transformers' (dt B) x
        h[0] += decay[0] * state
        scan_chunk(decay, h, parallel)
        ys.append((h @ C[s, ..., None]).squeeze(-1))
        state = h[-1]
    return torch.cat(ys) + D * x, state


def scan_chunk(decay: torch.Tensor, h: torch.Tensor, parallel: bool) -> None:
    """h_t += decay_t h_(t-1) over the chunk, in place. Parallel: a Hillis-Steele scan over the pairs (decay, input),
    log2(chunk) steps of a few ops, products of decays <= 1 only (stable): few kernel launches on a GPU. Else one
    fused op per token, which on CPUs moves less memory (and is faster) than the scan's log2(chunk) passes."""
    if not parallel:
        for t in range(1, h.shape[0]):
            h[t].addcmul_(decay[t], h[t - 1])
        return
    step = 1
    while step < h.shape[0]:  # h_t += (decay_t ... decay_(t-step+1)) h_(t-step): sums over 2 * step tokens
        h[step:] = h[step:] + decay[step:] * h[:-step]
        decay[step:] = decay[step:] * decay[:-step]
        step *= 2


def selective_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token of each of S sequences: x, dt [S, I], B, C [S, N], state [S, I, N] (updated in place) -> y [S, I];
    with heads (see selective_scan) x, dt [S, H, P], B, C [S, H, N], state [S, H, P, N] -> y [S, H, P]."""
    state.mul_((dt[..., None] * A).exp()).add_(dt[..., None] * B[..., None, :] * x[..., None])
    return (state @ C[..., None]).squeeze(-1) + D * x


@dataclass(frozen=True)
class MambaSettings:
    """A family's Mamba-1 mixer settings, from its own config names."""
    hidden_size: int
    intermediate_size: int
    state_size: int
    conv_kernel: int
    time_step_rank: int
    conv_bias: bool
    proj_bias: bool
    hidden_act: str
    dt_bc_norm_eps: float | None = None  # RMS norms on dt, B and C (Falcon-Mamba, Jamba); None: none (Mamba)
    dt_bc_norm_weights: bool = True  # Jamba's have weights; Falcon-Mamba's not
    n_heads: int = 1  # MultiHeadMambaMixer's (Zamba's n_mamba_heads)


class MambaMixer(RecurrentLayer):
    """The mixer of one layer. Under tensor parallelism each rank holds its intermediate channels: their x and z rows
    of in_proj, conv channels, dt_proj rows, A_log, D and state, x_proj's and out_proj's input columns. x_proj's
    output (dt, B, C) needs every channel: its partial products are all-reduced (before the dt/B/C norms), as in
    vLLM. intermediate_size is this rank's."""

    def __init__(self, s: MambaSettings):
        if s.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {s.hidden_act!r} for the Mamba conv; only 'silu' is implemented")
        if s.intermediate_size % tp_size():
            raise ValueError(f"intermediate_size={s.intermediate_size} of the Mamba mixer does not split over "
                             f"tensor_parallel_size={tp_size()}")
        channels = s.intermediate_size // tp_size()
        super().__init__(s.conv_kernel, channels, (channels, s.state_size))
        self.intermediate_size, self.state_size, self.time_step_rank = channels, s.state_size, s.time_step_rank
        # Weight holders: the conv runs in causal_conv.
        self.conv1d = RowShardedWeight([(s.intermediate_size, True)], (1, s.conv_kernel), s.conv_bias)
        self.out_proj = RowParallelLinear(s.intermediate_size, s.hidden_size, s.proj_bias)
        self.make_ssm_projections(s)

    def make_ssm_projections(self, s: MambaSettings) -> None:
        """in_proj (x, then z), x_proj (dt, B, C), dt_proj, A_log and D, and the dt/B/C norms where the family has
        them."""
        channels = self.intermediate_size
        self.in_proj = MergedColumnParallelLinear(s.hidden_size, [s.intermediate_size] * 2, s.proj_bias)
        self.x_proj = RowParallelLinear(s.intermediate_size, s.time_step_rank + 2 * s.state_size)
        # transformers adds dt_proj's bias after the matmul, in fp32.
        self.dt_proj = RowShardedWeight([(s.intermediate_size, True)], (s.time_step_rank,), True)
        self.A_log = nn.Parameter(torch.empty(channels, s.state_size), requires_grad=False)
        self.D = nn.Parameter(torch.empty(channels), requires_grad=False)
        self.dt_layernorm = self.b_layernorm = self.c_layernorm = None
        if s.dt_bc_norm_eps is not None:
            norm = RMSNorm if s.dt_bc_norm_weights else WeightlessRMSNorm
            self.dt_layernorm = norm(s.time_step_rank, s.dt_bc_norm_eps)
            self.b_layernorm = norm(s.state_size, s.dt_bc_norm_eps)
            self.c_layernorm = norm(s.state_size, s.dt_bc_norm_eps)

    def split_x_z(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return projected.chunk(2, -1)

    def ssm_inputs(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The conv's output x [tokens, channels] -> the scan's x, dt (after softplus), B and C in `dtype`."""
        time_step, B, C = self.x_proj(x).split([self.time_step_rank, self.state_size, self.state_size], -1)
        if self.dt_layernorm is not None:
            time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
        dt = F.softplus(F.linear(time_step, self.dt_proj.weight).to(dtype) + self.dt_proj.bias.to(dtype))
        return x.to(dtype), dt, B.to(dtype), C.to(dtype)

    def forward(self, hidden_states: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        x, z = self.split_x_z(self.in_proj(hidden_states))
        x = self.causal_conv(x, self.conv1d.weight.squeeze(1), batch, self.conv1d.bias)
        dtype = self.ssm_state.dtype
        A, D = -self.A_log.to(dtype).exp(), self.D.to(dtype)
        y = self.scan(batch, lambda x, dt, B, C, state: selective_state_update(x, dt, A, B, C, D, state),
                      lambda x, dt, B, C, state: selective_scan(x, dt, A, B, C, D, state), *self.ssm_inputs(x, dtype))
        return self.out_proj((y.flatten(1) * F.silu(z.to(dtype))).to(hidden_states.dtype))


class MultiHeadMambaMixer(MambaMixer):
    """Zamba's mixer: the channels in n_heads heads, each with its own x_proj [dt_rank + 2 d_state, head_dim] and
    dt_proj [head_dim, dt_rank], so its own dt, B and C; A_log, D and the state per head; in_proj's x and z rows
    interleaved channel by channel (transformers views its output as [channels, 2]). Under tensor parallelism each
    rank holds its heads: a contiguous share of in_proj's rows is its channels' x and z, and x_proj stays within a
    head, so nothing is all-reduced before out_proj."""

    def make_ssm_projections(self, s: MambaSettings) -> None:
        if s.n_heads % tp_size():
            raise ValueError(f"n_mamba_heads={s.n_heads} of the Mamba mixer does not split over "
                             f"tensor_parallel_size={tp_size()}")
        heads, head_dim = s.n_heads // tp_size(), s.intermediate_size // s.n_heads
        self.num_heads, self.head_dim = heads, head_dim
        self.ssm_state_shape = (heads, head_dim, s.state_size)
        self.in_proj = ColumnParallelLinear(s.hidden_size, 2 * s.intermediate_size, s.proj_bias)
        # Loaded by RecurrentLayer.weight_loader: this rank's heads (dim 0) of each.
        empty = lambda *shape: nn.Parameter(torch.empty(heads, *shape), requires_grad=False)  # noqa: E731
        self.x_proj_weight = empty(s.time_step_rank + 2 * s.state_size, head_dim)
        self.dt_proj_weight, self.dt_proj_bias = empty(head_dim, s.time_step_rank), empty(head_dim)
        self.A_log, self.D = empty(head_dim, s.state_size), empty(head_dim)

    def split_x_z(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return projected.unflatten(-1, (-1, 2)).unbind(-1)

    def ssm_inputs(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """x [tokens, channels] -> x, dt [tokens, heads, head_dim], B, C [tokens, heads, d_state] in `dtype`."""
        x = x.unflatten(-1, (self.num_heads, self.head_dim))
        ssm_parameters = torch.einsum("thp,hrp->thr", x, self.x_proj_weight)
        time_step, B, C = ssm_parameters.split([self.time_step_rank, self.state_size, self.state_size], -1)
        dt = torch.einsum("thr,hpr->thp", time_step, self.dt_proj_weight).to(dtype) + self.dt_proj_bias.to(dtype)
        return x.to(dtype), F.softplus(dt), B.to(dtype), C.to(dtype)
