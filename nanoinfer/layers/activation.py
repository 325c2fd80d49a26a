"""Gated activations of GLU MLPs, applied to a merged gate/up projection: act(gate) * up, by the config's name; the
plain activations of dense (ungated) MLPs, by the same names, as transformers computes each."""
import functools
import math
from collections.abc import Callable

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


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' "gelu_new" (Phi's, GPT-2's): the tanh approximation written out, op for op as its
    NewGELUActivation, which rounds differently from torch's fused kernel ("gelu_pytorch_tanh")."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """transformers' "gelu_fast" (GPT-NeoX-20B's): the tanh approximation factored its own way, op for op as its
    FastGELUActivation."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's GeLU (transformers' bloom_gelu_forward): the tanh approximation with its own rounded constant, op for
    op."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """transformers' "relu2" (Arcee's, Nemotron's): relu(x) ** 2."""
    return torch.square(F.relu(x))


_ACT = {
    "bloom_gelu": bloom_gelu,
    "gelu": F.gelu,  # exact (erf): Pythia
    "gelu_fast": gelu_fast,
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),  # StarCoder2
    "relu": F.relu,  # OPT
    "relu2": relu_squared,
    "silu": F.silu,
}


class ActAndMul(nn.Module):
    """act(gate) * up for a plain activation (exact GeLU: Zamba2's MLP; the tanh GeLU: Gemma's; relu2: BitNet's), with
    torch's own ops on every device."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return self.act(gate) * up


_GATED = ("silu", "gelu", "gelu_pytorch_tanh", "relu2")  # the activations of gated MLPs here


def get_act_and_mul(name: str) -> nn.Module:
    """The gated activation a config's `hidden_act` (or Gemma's `hidden_activation`) names."""
    if name not in _GATED:
        raise ValueError(f"unsupported hidden activation {name!r}; implemented: {sorted(_GATED)}")
    return SiluAndMul() if name == "silu" else ActAndMul(_ACT[name])


class XIELU(nn.Module):
    """transformers' xIELU (Apertus's MLP) as its Python fallback computes it, with each layer's learned alpha_p and
    alpha_n and the checkpoint's beta and eps: softplus(alpha_p) x^2 + beta x where x > 0, else
    (expm1(min(x, eps)) - x)(beta + softplus(alpha_n)) + beta x."""

    def __init__(self):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.beta = nn.Parameter(torch.tensor(0.5), requires_grad=False)
        self.eps = nn.Parameter(torch.tensor(-1e-6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


def get_act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config's `hidden_act` names, for an ungated MLP; "xielu": a module of the layer's own (its
    learned parameters)."""
    if name == "xielu":
        return XIELU()
    if name not in _ACT:
        raise ValueError(f"unsupported hidden activation {name!r}; implemented: {sorted([*_ACT, 'xielu'])}")
    return _ACT[name]
