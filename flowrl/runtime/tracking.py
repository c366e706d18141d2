"""Experiment trackers: every metric of a run, and tables of sample completions, sent to the
libraries users watch runs in (``flowrl run --log tensorboard,wandb,mlflow``).

One small adapter per tracker behind the :class:`Tracker` protocol, named by the catalogue
(:data:`flowrl.catalog.loggers.LOGGERS`: each record's ``adapter``), and :class:`Trackers`,
which fans a run's records out to all of them and to ``samples.jsonl``:

* :class:`TensorBoardLogger`: event files under ``RUN_DIR/tensorboard`` (scalars; samples as a
  Markdown table in the text tab).
* :class:`WandbLogger`: Weights & Biases in offline mode (``WANDB_MODE=offline``: no network)
  under ``RUN_DIR/wandb``; samples as a ``wandb.Table``. ``wandb sync`` uploads it later.
* :class:`MlflowLogger`: MLflow's local file store under ``RUN_DIR/mlruns``; samples appended to
  the table artifact ``samples.json`` (``mlflow.log_table``'s format).

Steps are the run's step numbers (1 = the first RL step, 0 = before RL). Each library is
imported only when its tracker is built, so a run without ``--log`` pays for none of them.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any, Protocol

from flowrl.catalog.loggers import LOGGERS
from flowrl.catalog.ops import OpKind
from flowrl.runtime.observe import atomic_write_text
from flowrl.runtime.rundir import own, tmp_sibling

SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward")
"""The columns of a samples table, in order."""


class Tracker(Protocol):
    """What a run hands each tracker."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Every finite scalar of one step (keys like ``reward/mean``)."""

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A table of completions (:data:`SAMPLE_COLUMNS`) of one step."""

    def close(self) -> None:
        """Flush and finish (idempotent)."""


def _scalars(metrics: dict) -> dict[str, float]:
    """The finite real values of ``metrics`` as floats (NaN/inf and non-numbers left out)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def markdown_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (what TensorBoard's text tab renders); ``|`` and newlines escaped."""

    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "⏎")

    head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(cell(r[c]) for c in SAMPLE_COLUMNS) + " |\n" for r in rows)


class TensorBoardLogger:
    """TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``) in ``RUN_DIR/tensorboard``."""

    def __init__(self, out: Path, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / LOGGERS["tensorboard"].folder))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, sort_keys=True) + "\n```", 0)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict]) -> None:
        self.writer.add_text("samples", markdown_table(rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Weights & Biases, offline: ``RUN_DIR/wandb/offline-run-*/run-*.wandb`` (no network is used)."""

    def __init__(self, out: Path, name: str, config: dict):
        import wandb

        os.environ["WANDB_MODE"] = "offline"  # never the network, whatever the user's wandb settings say
        self._wandb = wandb
        folder = out / LOGGERS["wandb"].folder
        folder.mkdir(parents=True, exist_ok=True)
        # One W&B run id per run directory: a resumed run writes a new offline run with the same
        # id, and `wandb sync` puts both parts into one W&B run.
        id_file = folder / "flowrl_run_id"
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:8])  # W&B ids: lowercase letters and digits
        from flowrl.runtime.environment import environ_for

        with environ_for("tracker"):  # W&B's service process starts here: the scrubbed environment, no key
            self.run = wandb.init(mode="offline", dir=str(out), project=os.environ.get("WANDB_PROJECT", "flowrl"),
                                  name=name, id=_run_id(id_file), config=config, reinit="create_new",
                                  settings=wandb.Settings(console="off", silent=True))
        self._closed = False

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_scalars(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r[c] for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"samples": table}, step=step)  # same step as its metrics: one history row

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()


def _run_id(file: Path) -> str:
    """The W&B run id this run directory keeps (:class:`WandbLogger`): lowercase letters and digits, or a
    clear error naming the file (it was damaged or replaced)."""
    text = file.read_bytes()[:200].decode("ascii", errors="replace").strip()
    if not re.fullmatch(r"[a-z0-9]{1,64}", text):
        from flowrl.runtime.errors import RuntimeFlowError

        raise RuntimeFlowError(f"{file} is not a W&B run id this flowrl wrote (lowercase letters and digits); hint: it was damaged "
                               "or replaced: delete it (the resumed run then logs to a new W&B run), or start a new run")
    return text


class MlflowLogger:
    """MLflow's local file store in ``RUN_DIR/mlruns`` (experiment ``flowrl``, one MLflow run per flowrl run)."""

    def __init__(self, out: Path, name: str, config: dict):
        # The file store is in maintenance mode in MLflow 3 and refuses to open unless asked:
        # it is the store that needs no database or server, which is what a run directory wants.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._Metric = Metric
        store = out / LOGGERS["mlflow"].folder
        self.client = MlflowClient(tracking_uri=store.resolve().as_uri())
        try:  # the store's files are read with MLflow's safe YAML loader: a replaced one is an error, never code
            experiment = self.client.get_experiment_by_name("flowrl")
            exp_id = experiment.experiment_id if experiment else self.client.create_experiment("flowrl")
            earlier = self.client.search_runs([exp_id], f"attributes.run_name = '{name}'")
        except Exception as e:  # noqa: BLE001 - MLflow's own errors, YAML's, a file that is not text
            from flowrl.runtime.errors import RuntimeFlowError

            raise RuntimeFlowError(f"the MLflow store {store} cannot be read ({type(e).__name__}: "
                                   f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); hint: it was "
                                   "damaged or replaced: move it away (the resumed run then starts a new MLflow "
                                   "run), or start a new run") from None
        if earlier:  # a resumed run continues its MLflow run (the same metrics, on one step axis)
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in sorted(_flatten(config).items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        self._closed = False

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [self._Metric(mlflow_key(key), value, now, step) for key, value in sorted(_scalars(metrics).items())]
        for i in range(0, len(batch), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_samples(self, step: int, rows: list[dict]) -> None:
        data = {c: [r[c] for r in rows] for c in SAMPLE_COLUMNS}
        self.client.log_table(self.run_id, data=data, artifact_file="samples.json")  # appends to the table

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id)


def mlflow_key(key: str) -> str:
    """``key`` as MLflow accepts a metric name (letters, digits, ``_ - . / :`` and spaces): any other
    character, such as the ``#`` of a repeated call's op id (``time/dapo#2.update``), becomes ``_``.

    >>> mlflow_key("time/dapo#2.update"), mlflow_key("reward/mean")
    ('time/dapo_2.update', 'reward/mean')
    """
    return re.sub(r"[^\w\-./: ]", "_", key)


def _flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def build_tracker(name: str, out: Path, run_name: str, config: dict) -> Tracker:
    """The tracker the catalogue names ``name`` (its ``adapter``); ValueError for an unknown name."""
    spec = LOGGERS.get(name)
    if spec is None:
        raise ValueError(f"unknown logger `{name}`; the known loggers are {', '.join(LOGGERS)}")
    module, _, cls = spec.adapter.partition(":")
    return getattr(importlib.import_module(module), cls)(out, run_name, config)


class Trackers:
    """The run's trackers plus ``samples.jsonl``: what the run loop calls once per step.

    ``names`` are catalogue names (the plan's ``run.log``); ``samples_every`` is the plan's
    ``run.log_samples`` (0: no samples). Samples go to ``RUN_DIR/samples.jsonl`` (one JSON
    object per completion, :data:`SAMPLE_COLUMNS`) whether or not trackers are named.
    A resumed run appends: TensorBoard reads both processes' event files as one run, MLflow
    continues the same run, W&B writes a second offline run with the same id.
    """

    def __init__(self, out: Path, names: tuple[str, ...], run_name: str, config: dict, samples_every: int = 0):
        self.out = out
        self.samples_every = int(samples_every)
        self.trackers: list[Tracker] = []
        # listed as flowrl's before they are written: the samples, and each tracker's folder (its library fills it)
        own(out, "samples.jsonl", tmp_sibling(out / "samples.jsonl"), *(LOGGERS[n].folder for n in names if n in LOGGERS))
        try:
            for name in names:
                self.trackers.append(build_tracker(name, out, run_name, config))
        except BaseException:
            self.close()
            raise

    def resume_after(self, step: int) -> None:
        """A run resumed from the checkpoint of ``step`` does the later steps again: the sample rows the
        stopped run wrote for them go (as their ``metrics.jsonl`` rows do), and a torn last line with them."""
        path = self.out / "samples.jsonl"
        if not path.is_file():
            return
        kept = []
        # JSON lines only (a replaced file runs nothing): a line that is not one is dropped
        for line in path.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True):
            try:
                earlier = int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash mid-write: its step is done again
            if earlier:
                kept.append(line if line.endswith("\n") else line + "\n")
        atomic_write_text(path, "".join(kept))

    def wants_samples(self, step: int) -> bool:
        """Whether step ``step`` (1-based) logs a samples table."""
        return self.samples_every > 0 and step % self.samples_every == 0

    def log(self, step: int, metrics: dict, samples: list[dict] | None = None) -> None:
        """One step: its samples (if given) and its metrics, to every tracker."""
        if samples:
            with open(self.out / "samples.jsonl", "a", encoding="utf-8") as f:
                for row in samples:
                    f.write(json.dumps({c: row[c] for c in SAMPLE_COLUMNS}, ensure_ascii=False) + "\n")
            for t in self.trackers:
                t.log_samples(step, samples)
        for t in self.trackers:
            t.log_metrics(step, metrics)

    def close(self) -> None:
        errors = []
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # one tracker failing to close must not lose the others
                errors.append(e)
        self.trackers = []
        if errors:
            raise errors[0]


def step_samples(plan, values: dict, step: int, limit: int = 16) -> list[dict]:
    """Up to ``limit`` completions of one step as :data:`SAMPLE_COLUMNS` rows: for each ``score``
    op of the plan, the prompts and texts of the rollouts it scored, and their rewards.

    ``values`` are the step's op values (op id -> the fields it produced; a ``generate``'s
    texts are its rollouts record's ``texts``: decoded text is not a field of the experience table).
    """
    rows: list[dict] = []
    for op in plan.ops:
        if op.kind != OpKind.SCORE or op.id not in values or op.inputs.get("rollouts") not in values:
            continue
        roll, scored = values[op.inputs["rollouts"]], values[op.id]
        texts = getattr(getattr(roll, "rollouts", None), "texts", None)
        prompts = _field(roll, "prompt_text")
        rewards = _field(scored, "rewards")
        if texts is None or rewards is None:
            continue
        rewards = rewards.tolist() if hasattr(rewards, "tolist") else list(rewards)
        for i, (text, reward) in enumerate(zip(texts, rewards)):
            if len(rows) >= limit:
                return rows
            prompt = prompts[i] if prompts is not None and i < len(prompts) else ""
            rows.append({"step": step, "prompt": str(prompt), "completion": str(text), "reward": float(reward)})
    return rows


def _field(value, key: str):
    try:
        return value[key] if key in value else None
    except TypeError:
        return None
