"""LFM2's gated short convolution: in_proj -> B, C, x; a causal depthwise conv of width L_cache over B * x, carried
across steps in a per-sequence conv state; C * conv -> out_proj. Its channels are sharded over tensor-parallel ranks."""
import torch
from torch import nn

from nanoinfer.layers.linear import MergedColumnParallelLinear, RowParallelLinear, copy_weight
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer
from nanoinfer.utils.dist import tp_rank, tp_size


class ShortConv(RecurrentLayer):
    """Holds the conv's weight [channels, K] and bias itself (checkpoint: `conv.weight` [hidden, 1, K], `conv.bias`,
    loaded here under the names `conv_weight`, `conv_bias`), this rank's channels of them."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool):
        if hidden_size % tp_size():
            raise ValueError(f"hidden_size={hidden_size} does not split over tensor_parallel_size={tp_size()}")
        channels = hidden_size // tp_size()
        super().__init__(kernel_size, channels)
        self.in_proj = MergedColumnParallelLinear(hidden_size, [hidden_size] * 3, bias)
        self.conv_weight = nn.Parameter(torch.empty(channels, kernel_size), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        loaded = loaded[...]
        loaded = loaded.squeeze(1) if loaded.dim() == 3 else loaded  # nn.Conv1d's [out, in / groups = 1, K]
        rows = param.shape[0]
        if loaded.shape[0] != rows * tp_size():
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, parameter {tuple(param.shape)}"
                             f" on each of {tp_size()} ranks")
        copy_weight(param, loaded.narrow(0, tp_rank() * rows, rows))

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        b, c, x = self.in_proj(x).chunk(3, -1)
        return self.out_proj(c * self.causal_conv(b * x, self.conv_weight, batch, self.conv_bias, silu=False))
