"""A run directory someone hands you runs none of their code on ``--resume``.

One short real run (Ray, the torch engines, the tiny model; staleness 3 and partial rollout, so a
checkpoint holds in-flight steps and carried groups; every tracker and a samples log), with a
checkpoint after every step. Then, in a copy of the run, *every file the run wrote* (enumerated from
the directory: a file added later is covered without touching this test, and a container format with
no tamper case fails it) is replaced by a pickle whose loading writes a marker file (for a
``torch.save`` file, the same payload in torch's own container), each checkpoint's manifest rewritten
to match (its CRC-32s are no protection), and the copy is resumed. A file the resume reads must be
refused with a one-line error naming it or its folder (a user error, not a traceback); those files
are then put back and the resume tried again, until it runs to its end with every file it never
reads still replaced. The marker never appears.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
import sys
import traceback
import zlib
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from e2e_kit import local_ray, make_workdir  # noqa: E402

from flowrl.launch import RunError, run_file  # noqa: E402
from flowrl.runtime.errors import user_error  # noqa: E402

pytestmark = [pytest.mark.timeout(900)]

FLOW = """import stdlib.grpo
model policy = hf("model")
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl")
reward sevens = python_reward("e2e_rewards:sevens", workers = 1)
flow main(steps: int = 2, eval_every: int = 0, log: str = "tensorboard,wandb,mlflow", log_samples: int = 1) {
  grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 4, lr = 3e-3, kl = 0.0, seed = 1)
}
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  policy.rollout = hf_generate()
  staleness 3
  partial_rollout(over_provision = 1.5)
}
"""


class Payload:
    """Loading it (pickle, or torch.load without weights_only) creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickled(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def torch_saved(marker: Path) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    return buf.getvalue()


TAMPER = {".pt": torch_saved}
"""Container formats (by suffix) -> the hostile content in that container; any other file gets the bare
pickle (JSON, text, safetensors, PNG, the trackers' files), and a zip or numpy file not listed here fails
the test (its reader would meet the payload inside the container, not as the whole file)."""
CONTAINERS = (b"PK\x03\x04", b"\x93NUMPY")


def payload(path: Path, marker: Path) -> bytes:
    if path.suffix in TAMPER:
        return TAMPER[path.suffix](marker)
    assert not path.read_bytes()[:8].startswith(CONTAINERS), \
        f"{path}: a container format with no tamper case; add its suffix to TAMPER"
    return pickled(marker)

MUST_BE_READ = {"checkpoints/step_*/driver.json", "checkpoints/step_*/inflight.json",
                "checkpoints/step_*/inflight.safetensors", "checkpoints/step_*/partial.json",
                "checkpoints/step_*/manifest.json", "checkpoints/step_*/policy/engine_state.pt"}
"""Kinds a resume reads: each must be refused by name (the rest may go unread)."""


def kind_of(rel: str) -> str:
    return re.sub(r"step_\d+", "step_*", rel)


def named_in(message: str, copy: Path, tampered: set[str]) -> set[str]:
    """The replaced files ``message`` names: by path, else by a folder holding them, else by file name."""
    by_path = {k for k in tampered if str(copy / k) in message}
    if by_path:
        return by_path
    by_folder = {k for k in tampered for i in range(1, len(Path(k).parts))
                 if any(f"{copy.joinpath(*Path(k).parts[:i])}{end}" in message + " " for end in " :;,)")}
    return by_folder or {k for k in tampered if Path(k).name in message}


def rewrite_manifests(run: Path) -> None:
    """Each checkpoint's manifest recomputed over its files as they now are (anyone can)."""
    for ckpt in (run / "checkpoints").glob("step_*"):
        files = {}
        for p in sorted(q for q in ckpt.rglob("*") if q.is_file() and q.name != "manifest.json"):
            data = p.read_bytes()
            files[p.relative_to(ckpt).as_posix()] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):#010x}"}
        (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True))


@pytest.fixture(scope="module")
def ray_address():
    yield from local_ray()


@pytest.mark.slow  # a run, then a resume per file the resume refuses (112 s on a loaded 2-core machine)
def test_every_file_a_run_writes_replaced_by_a_pickle_runs_nothing_on_resume(tmp_path, ray_address):
    work = make_workdir(tmp_path, rows=40, train=32)
    (work / "t.flow").write_text(FLOW)
    run = work / "run"
    run_file(str(work / "t.flow"), out=str(run), save_every=1, ray_address=ray_address, stream=io.StringIO())
    assert (run / "checkpoints" / "step_000001" / "inflight.safetensors").is_file()  # the case has tensors in flight

    files = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())
    payloads = {rel: payload(run / rel, tmp_path / "code-ran") for rel in files}
    kinds = {kind_of(rel) for rel in files}
    assert MUST_BE_READ <= kinds and {"wandb/flowrl_run_id", "samples.jsonl"} <= kinds

    marker = tmp_path / "code-ran"
    tampered, refused = set(kinds), {}
    for attempt in range(len(files) + 1):
        copy = tmp_path / f"attempt{attempt}"
        shutil.copytree(run, copy)
        for rel in files:
            if kind_of(rel) in tampered:
                (copy / rel).write_bytes(payloads[rel])
        if "checkpoints/step_*/manifest.json" not in tampered:
            rewrite_manifests(copy)
        try:
            run_file(None, resume=str(copy), resume_step=1, ray_address=ray_address, stream=io.StringIO())
        except Exception as e:  # noqa: BLE001 - what matters is what it says
            message = str(e).splitlines()[0] if isinstance(e, RunError) else user_error(e)  # RunError: the CLI's own
            assert message is not None, "a replaced file ended in a traceback:\n" + "".join(traceback.format_exception(e))
            named = named_in(message, copy, tampered)
            assert named, f"the error names none of the replaced files {sorted(tampered)}: {message}"
            refused.update((k, message) for k in named)
            tampered -= named
        else:
            break
        finally:
            assert not marker.exists(), f"loading a replaced file ran code (attempt {attempt}, replaced: {sorted(tampered)})"
    else:
        pytest.fail(f"the resume never finished; refused: {refused}")
    assert MUST_BE_READ <= set(refused), f"read without being refused: {sorted(MUST_BE_READ - set(refused))}"
    assert not marker.exists()
