"""fp32 master weights for a 16-bit model trained by a torch optimizer (``precision = "mixed"``).

The model keeps its 16-bit parameters: the forward and backward run in them, and they are the
tensors a weight sync sends (so the rollout engine serves exactly what the trainer computes with).
:class:`MasterWeights` holds an fp32 copy of each trainable 16-bit parameter; the optimizer
updates those copies. One step:

1. ``backward`` leaves 16-bit gradients on the model's parameters;
2. :meth:`MasterWeights.grads_to_masters` moves each into its master's fp32 ``grad`` (and frees the
   16-bit one: peak 4 bytes of gradient per parameter, as Megatron's fp32 grad buffers);
3. clipping and AdamW run on the masters (fp32 gradients, fp32 moments);
4. :meth:`MasterWeights.masters_to_model` casts the masters back into the parameters (round to
   nearest even, in place: views and a weight sync's buffers stay valid).

This is Megatron's ``Float16OptimizerWithFloat16Params`` and DeepSpeed's bf16 optimizer. An update
below half a unit in the last place of a bf16 weight is kept in the master and shows in the
weight once the sum of such updates reaches it; with ``pure`` it is rounded away at every step.

fp32 parameters (LoRA adapters, which PEFT keeps in fp32; a float32 model) are their own masters.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
>>> mw = MasterWeights([w], enabled=True)
>>> opt = torch.optim.SGD(mw.params, lr=1e-3)  # 1e-3 is under half of bf16's ulp at 1.0 (2**-7)
>>> for _ in range(8):
...     w.grad = torch.ones_like(w); mw.grads_to_masters(); opt.step(); mw.masters_to_model()
>>> w[0].item(), round(mw.params[0][0].item(), 4)
(0.9921875, 0.992)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from flowrl.engines.base import EngineError


class MasterWeights:
    """fp32 masters of the 16-bit parameters in ``params`` (``enabled``; else each parameter is its own)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, enabled: bool):
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        for p in params:
            if enabled and p.dtype != torch.float32 and p.is_floating_point():
                master = torch.nn.Parameter(p.detach().float().clone())
                self.pairs.append((p, master))
            else:
                self.pairs.append((p, p))

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates: the masters (a parameter that is its own master, itself)."""
        return [master for _, master in self.pairs]

    @property
    def active(self) -> bool:
        """Whether any parameter has a separate fp32 master."""
        return any(p is not m for p, m in self.pairs)

    def grads_to_masters(self) -> None:
        """Each 16-bit parameter's gradient into its master's ``grad`` (fp32), freeing the 16-bit one."""
        for p, m in self.pairs:
            if p is m:
                continue
            m.grad = None if p.grad is None else p.grad.detach().float()
            p.grad = None

    def masters_to_model(self) -> None:
        """Cast the masters into the model's parameters, in place."""
        with torch.no_grad():
            for p, m in self.pairs:
                if p is not m:
                    p.copy_(m)

    def from_model(self) -> None:
        """Set the masters to the model's parameters (a model loaded without them)."""
        with torch.no_grad():
            for p, m in self.pairs:
                if p is not m:
                    m.copy_(p)

    def zero_grad(self) -> None:
        """Drop the gradients of the parameters and of the masters."""
        for p, m in self.pairs:
            p.grad = None
            m.grad = None

    def state(self) -> list[torch.Tensor]:
        """The separate masters' values (fp32), in parameter order, for a checkpoint."""
        return [m.detach() for p, m in self.pairs if p is not m]

    def load_state(self, masters: list[torch.Tensor]) -> None:
        """Restore :meth:`state` (the same model); the 16-bit parameters are cast from the masters again."""
        mine = [m for p, m in self.pairs if p is not m]
        if len(masters) != len(mine):
            raise EngineError(f"the checkpoint holds {len(masters)} fp32 master weights, this engine has "
                              f"{len(mine)}; resume with the precision and dtype it was saved with")
        with torch.no_grad():
            for m, saved in zip(mine, masters):
                m.copy_(saved)
        self.masters_to_model()


__all__ = ["MasterWeights"]
