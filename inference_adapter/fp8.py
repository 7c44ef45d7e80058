"""Served block FP8 on the reference server: linear layers that hold ``weight`` (e4m3fn) and ``weight_scale_inv``
(fp32) as SGLang's ``Fp8LinearMethod`` registers them (``wsync serve --quantization fp8``). The format:
:mod:`bridge.codecs.fp8`."""

from __future__ import annotations

import torch

from bridge.codecs.fp8 import Fp8Rule, dequantize, quantize

__all__ = ["Fp8Linear", "quantize_module"]


class Fp8Linear(torch.nn.Module):
    """A linear layer served as block FP8: ``weight`` (e4m3fn) and ``weight_scale_inv`` (fp32), computing with
    their block dequantization in the activations' dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        q, scale = quantize(linear.weight.detach())
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, dequantize(self.weight, self.weight_scale_inv, x.dtype), self.bias)


def quantize_module(model: torch.nn.Module, rule: Fp8Rule) -> list[str]:
    """Replace every linear layer whose weight the rule quantizes by an :class:`Fp8Linear`; their names."""
    done = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and rule.quantized(f"{name}.weight", tuple(mod.weight.shape)):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, Fp8Linear(mod))
            done.append(name)
    return done
