"""Gated activations of GLU MLPs, applied to a merged gate/up projection: act(gate) * up, by the config's name."""
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


class GeluTanhAndMul(nn.Module):
    """GeLU with the tanh approximation (transformers' "gelu_pytorch_tanh", Gemma's MLP); torch's own kernel on
    every device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.gelu(gate, approximate="tanh") * up


_ACT_AND_MUL = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def get_act_and_mul(name: str) -> nn.Module:
    """The gated activation a config's `hidden_act` (or Gemma's `hidden_activation`) names."""
    if name not in _ACT_AND_MUL:
        raise ValueError(f"unsupported hidden activation {name!r}; implemented: {sorted(_ACT_AND_MUL)}")
    return _ACT_AND_MUL[name]()
