"""The catalogue of experiment trackers: ``flowrl run --log NAME,...`` (or the flow's ``log`` setting).

One record per tracker: where it writes inside the run directory, the package it needs (and
how to install it), and the runtime class that writes to it (``module:Class``, never
imported here). The run-settings check (``flowrl check``), the command line and the runtime
read these records; a test pairs each with its runtime class.

>>> parse_loggers("tensorboard, mlflow")
('tensorboard', 'mlflow')
>>> parse_loggers("")
()
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoggerSpec:
    name: str
    doc: str
    adapter: str
    """The runtime class that writes to it, ``module:Class`` (see :mod:`flowrl.runtime.tracking`)."""
    package: str
    """The top-level module it imports (checked with ``importlib.util.find_spec`` before a run starts)."""
    install: str
    """How to install ``package``."""
    folder: str
    """Where it writes, relative to the run directory."""
    samples: str
    """The native table form the sample completions take in it."""


LOGGERS: dict[str, LoggerSpec] = {
    "tensorboard": LoggerSpec(
        "tensorboard", "TensorBoard event files (`tensorboard --logdir RUN_DIR/tensorboard`)",
        "flowrl.runtime.tracking:TensorBoardLogger", "tensorboard", "pip install tensorboard",
        "tensorboard", "a Markdown table per logged step (text tab, tag `samples`)"),
    "wandb": LoggerSpec(
        "wandb", "Weights & Biases, offline (no network): `wandb sync RUN_DIR/wandb/offline-run-*` uploads it",
        "flowrl.runtime.tracking:WandbLogger", "wandb", "pip install wandb",
        "wandb", "a `wandb.Table` (key `samples`) per logged step"),
    "mlflow": LoggerSpec(
        "mlflow", "MLflow's local file store (`mlflow ui --backend-store-uri RUN_DIR/mlruns`)",
        "flowrl.runtime.tracking:MlflowLogger", "mlflow", "pip install mlflow-skinny",
        "mlruns", "an MLflow table artifact `samples.json` (rows appended each logged step)"),
}
"""Tracker name -> record, in the order ``--help`` lists them."""


class UnknownLoggerError(ValueError):
    """A tracker name that is not in :data:`LOGGERS`; the message names the known ones."""


def parse_loggers(text: str) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` -> ``("tensorboard", "wandb")``: comma-separated, spaces ignored,
    duplicates dropped, order kept; ``""`` and ``"none"`` mean no tracker.

    Raises :class:`UnknownLoggerError` naming the known trackers (and the closest one).
    """
    import difflib

    names: list[str] = []
    for raw in str(text).split(","):
        name = raw.strip().lower()
        if not name or name == "none":
            continue
        if name not in LOGGERS:
            close = difflib.get_close_matches(name, list(LOGGERS), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise UnknownLoggerError(f"unknown logger `{raw.strip()}`: the known loggers are "
                                     f"{', '.join(LOGGERS)} (comma-separated){hint}")
        if name not in names:
            names.append(name)
    return tuple(names)
