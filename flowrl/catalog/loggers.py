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
        "wandb", "Weights & Biases: online with credentials (WANDB_API_KEY, `wandb login`) or WANDB_MODE=online, "
                 "else offline (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it)",
        "flowrl.runtime.tracking:WandbLogger", "wandb", "pip install wandb",
        "wandb", "a `wandb.Table` (key `samples`) per logged step"),
    "mlflow": LoggerSpec(
        "mlflow", "MLflow: the tracking server of `log_uri` or MLFLOW_TRACKING_URI, else the local file store "
                  "(`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri RUN_DIR/mlruns`)",
        "flowrl.runtime.tracking:MlflowLogger", "mlflow", "pip install mlflow-skinny",
        "mlruns", "an MLflow table artifact `samples.json` (rows appended each logged step)"),
}
"""Tracker name -> record, in the order ``--help`` lists them."""


TRACKING_SETTINGS: dict[str, str] = {
    "log_name": "the trackers' run name (default: $WANDB_NAME for W&B, else the run directory's name)",
    "log_project": "W&B project and MLflow experiment (default: $WANDB_PROJECT / $MLFLOW_EXPERIMENT_NAME, else flowrl)",
    "log_entity": "W&B entity, a team or user (default: $WANDB_ENTITY, else the account's default)",
    "log_group": "W&B run group; MLflow tag `group` (default: $WANDB_RUN_GROUP)",
    "log_tags": "tags of the trackers' run, comma-separated (MLflow: `key=value` or a bare key)",
    "log_uri": "MLflow tracking URI, e.g. http://127.0.0.1:5000 (default: $MLFLOW_TRACKING_URI, else RUN_DIR/mlruns)",
}
"""Run settings (flow parameters, ``--set``, ``flowrl run --log-name ...``) that name the trackers' run,
and what each means; every one a string."""


def uri_problem(uri: str) -> str | None:
    """What is wrong with ``uri`` as a tracking URI a run writes into its ``plan.json``, or None: a
    password in it (it would be written to the run directory; credentials belong in MLflow's
    variables). The password is masked in the message.

    >>> uri_problem("http://127.0.0.1:5000") is None
    True
    >>> uri_problem("https://me:hunter2@mlflow.example.com")
    'the tracking URI `https://me:***@mlflow.example.com` holds a password, which the run would write to its plan.json'
    """
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        password = parts.password
    except ValueError as e:
        return f"`{uri}` is not a URI ({e})"
    if password:
        masked = uri.replace(f":{password}@", ":***@", 1)
        return f"the tracking URI `{masked}` holds a password, which the run would write to its plan.json"
    return None


URI_HINT = ("give the URI without credentials, with MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
            "MLFLOW_TRACKING_TOKEN) in the environment; or set MLFLOW_TRACKING_URI instead (a run records it without "
            "its user and password)")
"""The hint of a tracking URI with a password (E513, ``--log-uri``)."""


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
