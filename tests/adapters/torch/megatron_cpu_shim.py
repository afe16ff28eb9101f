"""TEST-ONLY: let megatron-core 0.16.1's DDP and optimizers run on CPU torch (gloo).

Nothing here ships in the package; it is imported only by test worker processes (spawned fresh
for each job, so the patches never reach the pytest process or another test). megatron-core
hard-codes CUDA in a few places that have nothing to do with what the monitor observes; these
are the only patches needed (found by removing them one at a time):

- ``torch.cuda.current_device`` returns the CPU device (grad/param buffers are allocated on it);
- tensor factories given ``device="cuda"`` (or a device index) build on the CPU (found_inf, the
  loss-scale and norm-clipping scalars);
- ``Tensor.type()`` without arguments reports CPU tensors as ``torch.cuda.*Tensor``, which
  Megatron's optimizers check to tell fp32 from fp16/bf16 parameters.

The monitor itself never calls any of these with a CUDA device, so what the tests measure is
the real megatron-core code path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_CPU = torch.device("cpu")
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like", "arange")


def _on_cpu(factory: Any) -> Any:
    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and (str(device).startswith("cuda") or isinstance(device, int)):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    build.megatron_cpu_shim = True
    return build


def _cuda_type_names(original: Any) -> Any:
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, *args, **kwargs)

    type_.megatron_cpu_shim = True
    return type_


def install() -> None:
    """Apply the patches in this (test worker) process; a second call does nothing."""
    if getattr(torch.Tensor.type, "megatron_cpu_shim", False):
        return
    torch.cuda.current_device = lambda: _CPU
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.type = _cuda_type_names(torch.Tensor.type)
