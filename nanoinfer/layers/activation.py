"""SiLU-and-mul: the gated activation of SwiGLU MLPs, applied to a merged gate/up projection."""
import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.kernels import cpu as cpu_kernels
from nanoinfer.kernels.cuda import triton_layers


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.use_cpu_kernels(x):
            return cpu_kernels.silu_and_mul(x)
        if x.is_cuda and (kernels := triton_layers()) is not None:
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
