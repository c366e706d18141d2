"""What the end-to-end tests share: a work directory (a tiny local model and the arithmetic
task's prompts), flow files over it, and metric rows without their timings.

A module of its own (test folders' conftest modules share one name, so tests must not import
from them). Tests outside tests/runtime put :data:`RUNTIME_DIR` on ``sys.path`` to import it;
it is also where ``e2e_rewards`` (the flows' ``python_reward``) lives.
"""

from __future__ import annotations

import json
from pathlib import Path

RUNTIME_DIR = Path(__file__).resolve().parent
"""This folder: ``e2e_kit`` and ``e2e_rewards`` are imported from here."""

VOLATILE = ("time/", "perf/", "pipeline/", "sync/seconds", "sync/unpack_seconds", "sync/send_seconds",
            "sync/receive_seconds")
"""Metric prefixes that measure time: they differ between two runs of the same steps."""


def make_workdir(tmp: Path, rows: int = 120, train: int = 100, seed: int = 7) -> Path:
    """``tmp`` with ``model/`` (a tiny random-init model) and ``train.jsonl`` / ``test.jsonl``
    (the first ``train`` of ``rows`` arithmetic prompts, then the rest)."""
    from flowrl.models.tiny import build_tiny_model
    from flowrl.tasks.arith import make_split

    build_tiny_model(tmp / "model", seed=0)
    split = make_split(rows, seed)
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split[:train]))
    (tmp / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split[train:]))
    return tmp


def flow_text(body: str, steps: int, schedule: str = "", imports: tuple[str, ...] = ("grpo",),
              declarations: str = "") -> str:
    """A flow over :func:`make_workdir`'s files: ``body`` (a stdlib call) as ``main``, the
    ``e2e_rewards:sevens`` reward (and ``declarations``, lines of more), then ``schedule`` (a
    whole schedule block, or nothing)."""
    head = "".join(f"import stdlib.{name}\n" for name in imports)
    return f"""{head}model policy = hf("model")
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl")
reward sevens = python_reward("e2e_rewards:sevens", workers = 1)
{declarations}flow main(steps: int = {steps}, eval_every: int = 0) {{
  {body}
}}
{schedule}"""


def write_flow(path: Path, body: str, steps: int, schedule: str = "", imports: tuple[str, ...] = ("grpo",),
               declarations: str = "") -> Path:
    """:func:`flow_text` written to ``path`` (in the work directory: its paths are relative)."""
    path.write_text(flow_text(body, steps, schedule, imports, declarations))
    return path


def local_ray(gpus: int = 8):
    """A module fixture's body: one local Ray instance (``gpus`` logical GPUs) for every run of the
    module, its GCS address yielded for ``run_file(..., ray_address=...)`` (a run that joins it leaves
    it running); shut down at the end if this started it.

    Each run starting Ray of its own costs 8-10 s on 2 cores (start and shutdown); the runs place and
    release their own placement groups, so they share one instance as they would share a cluster.
    ``address="local"``: a new instance even when another Ray session runs on this machine.
    """
    import os

    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 2, 2), num_gpus=gpus, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        if started:
            ray.shutdown()


def stable(rows: list[dict]) -> list[dict]:
    """Metric rows without the :data:`VOLATILE` keys: what a resumed run must reproduce exactly."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def resume_copy(run_dir: Path, into: Path, step: int, **kwargs):
    """Continue a copy of the finished run ``run_dir`` (in ``into``) from its checkpoint of ``step``
    (``--resume-step``); returns the resumed run's result.

    A run killed after ``step`` and before its next checkpoint resumes from exactly that checkpoint
    (the runs are deterministic), so the resume tests skip running the killed run; a kill itself is
    tested once (tests/runtime/test_e2e.py::test_a_rollout_engine_killed_mid_step_is_restarted_from_the_checkpoint).
    """
    import shutil

    from flowrl.launch import run_file

    shutil.copytree(run_dir, into)
    return run_file(None, resume=str(into), resume_step=step, **kwargs)
