"""The catalogue of training precisions: how a model with a 16-bit ``dtype`` trains.

``hf(path, dtype = "bfloat16")`` (or ``tiny(dtype = "bfloat16")``) names the dtype the model computes in
and the rollout engine serves. Its ``precision`` option says what the train engine keeps besides:

* ``mixed`` (the default): fp32 master weights and fp32 Adam moments, as veRL, OpenRLHF and TRL
  train. The forward and backward run in the 16-bit dtype; the update is applied to the fp32
  masters and the 16-bit weights are cast from them (round to nearest) after each step, so an
  update smaller than the 16-bit dtype's resolution accumulates in the master instead of being
  lost. The weights a resync sends are those casts, the same tensors the trainer computes with.
  Each train engine does it its own way: ``torch`` keeps the 16-bit model and an fp32 copy of its
  trainable parameters in the optimizer (Megatron's ``Float16OptimizerWithFloat16Params``,
  DeepSpeed's bf16 optimizer); ``fsdp`` shards fp32 parameters and all-gathers them cast to the
  16-bit dtype (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, veRL's);
  ``megatron`` sets ``bf16=True`` in its optimizer config (fp32 main params, fp32 grad buffers).
* ``pure``: weights, gradients and Adam moments all in the 16-bit dtype (half the memory of
  ``mixed``'s state). An update below half a unit in the last place of a weight rounds back to
  the weight: with bf16's 8 bits of mantissa, a learning rate of 1e-6 leaves most weights as they
  were. Only when asked.

A float32 model trains in float32 either way.

>>> train_bytes("bfloat16", "mixed")
ParamBytes(weights=2, master=4, grads=4, states=8)
>>> train_bytes("bfloat16", "pure").total, train_bytes("float32", "mixed").total
(8, 16)
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each ``dtype`` a model may be declared with."""


@dataclass(frozen=True)
class PrecisionSpec:
    """One training precision (the ``precision`` option of the trainable model constructors)."""

    name: str
    master_weights: bool
    """A 16-bit model trains fp32 master weights and fp32 Adam moments (the weights it computes with
    cast from the masters after each step); False: weights, gradients and moments in the 16-bit dtype."""
    doc: str = ""


PRECISIONS: dict[str, PrecisionSpec] = {p.name: p for p in (
    PrecisionSpec("mixed", True, "compute in the model's 16-bit dtype; fp32 master weights, gradients and Adam "
                                 "moments (veRL, OpenRLHF, TRL)"),
    PrecisionSpec("pure", False, "weights, gradients and Adam moments in the model's 16-bit dtype (half the state "
                                 "memory; updates below the dtype's resolution are lost)"),
)}
"""Precision records by name; ``mixed`` is the default."""

DEFAULT_PRECISION = "mixed"


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per trained parameter a train engine holds, by part (before any sharding)."""

    weights: int
    """The weights the model computes with (its dtype)."""
    master: int
    """fp32 master weights (0 without)."""
    grads: int
    """Gradients at the optimizer step (fp32 under mixed precision: the masters')."""
    states: int
    """Adam's two moments."""

    @property
    def total(self) -> int:
        return self.weights + self.master + self.grads + self.states


def keeps_masters(dtype: str, precision: str) -> bool:
    """Whether a model of ``dtype`` trained at ``precision`` has fp32 master weights."""
    return DTYPE_BYTES[dtype] < 4 and PRECISIONS[precision].master_weights


def train_bytes(dtype: str, precision: str = DEFAULT_PRECISION) -> ParamBytes:
    """:class:`ParamBytes` of a model declared with ``dtype`` and ``precision``: float32 holds 4 + 4 + 8
    (weights, grads, moments); a 16-bit dtype under ``mixed`` 2 + 4 (master) + 4 + 8; under ``pure``
    2 + 2 + 4."""
    wb = DTYPE_BYTES[dtype]
    if wb >= 4:
        return ParamBytes(wb, 0, 4, 8)
    if PRECISIONS[precision].master_weights:
        return ParamBytes(wb, 4, 4, 8)
    return ParamBytes(wb, 0, wb, 2 * wb)


__all__ = ["DTYPE_BYTES", "PrecisionSpec", "PRECISIONS", "DEFAULT_PRECISION", "ParamBytes", "keeps_masters",
           "train_bytes"]
