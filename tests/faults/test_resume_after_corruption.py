"""One short real run (Ray, the torch rollout and train engines, the tiny model) that exercises
the faults a run survives without help, end to end:

* bad data rows (``bad_rows = "skip"``): left out, counted in ``data/rows_skipped``, named in events.log;
* the newest checkpoint damaged (one flipped byte): ``--resume`` refuses it naming the file, the
  checkpoint and both CRC-32s, and offers the previous one; ``--resume-step`` continues from it and
  reproduces the uninterrupted run's metrics (the re-run step is identical);
* a half-written checkpoint directory (a kill during the write) is ignored;
* the run directory is never world-writable, even under ``umask 0``;
* secrets in the environment (``HF_TOKEN``, ``WANDB_API_KEY``) appear in nothing the run writes.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from e2e_kit import make_workdir, stable  # noqa: E402

from flowrl.launch import run_file  # noqa: E402
from flowrl.runtime.errors import user_error  # noqa: E402

pytestmark = [pytest.mark.timeout(900)]

SECRETS = {"HF_TOKEN": "hf_faultsTestSecret0123456789", "WANDB_API_KEY": "wandb0faults0test0secret0value42"}

FLOW = """import stdlib.grpo
model policy = hf("model")
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl", bad_rows = "skip")
reward sevens = python_reward("e2e_rewards:sevens", workers = 1)
flow main(steps: int = 3, eval_every: int = 0) {
  grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 4, lr = 3e-3, kl = 0.0, seed = 1)
}
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  policy.rollout = hf_generate()
}
"""


def test_bad_rows_corrupted_checkpoint_resume_umask_and_secrets(tmp_path, monkeypatch):
    work = make_workdir(tmp_path, rows=40, train=32)
    with open(work / "train.jsonl", "ab") as f:  # lines 33-35: three bad rows
        f.write(b'{"prompt": "", "answer": "7"}\n{"prompt": "\xff7", "answer": "7"}\n{"answer": "7"}\n')
    path = work / "faults.flow"
    path.write_text(FLOW)
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    out = work / "run"
    previous = os.umask(0)  # the worst a user can have: the run still writes nothing world-writable
    try:
        first = run_file(str(path), out=str(out), save_every=1)
    finally:
        assert os.umask(previous) == 0  # the run restored the umask it found
    assert [r["data/rows_skipped"] for r in first.rows] == [3, 3, 3]
    events = [json.loads(x) for x in (out / "events.log").read_text().splitlines()]
    assert [e["bad_row"].split(": ")[0] for e in events if "bad_row" in e] == \
        [f"{work / 'train.jsonl'}:{n}" for n in (33, 34, 35)]
    for p in [out, *out.rglob("*")]:
        assert not p.stat().st_mode & stat.S_IWOTH, f"{p} is world-writable"
    for p in out.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            assert not any(v.encode() in data for v in SECRETS.values()), f"{p} holds a secret"

    # a bit flip in the newest checkpoint, and a half-written one after it
    target = out / "checkpoints" / "step_000003" / "policy" / "engine_state.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    (out / "checkpoints" / "step_000004.tmp").mkdir()
    with pytest.raises(Exception) as info:
        run_file(None, resume=str(out), steps=4)
    message = user_error(info.value) or str(info.value)
    assert "step_000003 is damaged: policy/engine_state.pt has CRC-32" in message, message
    assert f"`flowrl run --resume {out} --resume-step 2`" in message

    resumed = run_file(None, resume=str(out), steps=4, resume_step=2)
    assert [r["step"] for r in resumed.rows] == [1, 2, 3, 4]
    assert stable(resumed.rows[:3]) == stable(first.rows)  # step 3 ran again, identically
    assert (out / "checkpoints" / "step_000004" / "manifest.json").is_file()
