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


SHARED_GPUS = 8
"""Logical GPUs of the shared local Ray instance: as many as any in-process test's flow plans on one node."""


def shared_ray() -> str:
    """The GCS address of the one local Ray instance the in-process runs of every test module share,
    started by the first caller (:data:`SHARED_GPUS` logical GPUs, this machine's cores).

    Each run starting Ray of its own costs 8-18 s on 2 cores (start and shutdown); a run that joins
    an instance places and releases its own placement groups and actors, as it would on a cluster, and
    leaves it running. A module that needs a cluster of its own (``ray.cluster_utils.Cluster``) ends
    this instance first (:func:`end_shared_ray`); the next caller starts it again. The process's exit
    ends it (Ray's own exit hook).
    ``address="local"``: a new instance even when another Ray session runs on this machine.
    """
    import os

    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(os.cpu_count() or 2, 2), num_gpus=SHARED_GPUS,
                 include_dashboard=False, log_to_driver=False, configure_logging=False)
    return ray.get_runtime_context().gcs_address


def end_shared_ray() -> None:
    """Disconnect from (and so stop) the shared instance, before a module starts a cluster of its own."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def local_ray(gpus: int = SHARED_GPUS):
    """A module fixture's body: the shared instance's address (:func:`shared_ray`), for
    ``run_file(..., ray_address=...)``. ``gpus``: how many logical GPUs the module's flows need at most."""
    if gpus > SHARED_GPUS:
        raise ValueError(f"the shared Ray instance has {SHARED_GPUS} logical GPUs; {gpus} asked")
    yield shared_ray()


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
