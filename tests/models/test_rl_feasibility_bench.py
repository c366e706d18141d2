"""bench/rl_feasibility.py keeps running: a few-step smoke run, and its GRPO pieces on hand-made values."""

import json

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("rl_feasibility")


def test_group_advantages(bench):
    adv = bench.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group=4, eps=1e-6)
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()
    assert torch.allclose(adv[:4], (torch.tensor([1.0, 0.0, 0.0, 0.0]) - 0.25) / (std + 1e-6))
    assert torch.equal(adv[4:], torch.zeros(4))  # all-correct group: no signal


def test_ppo_clip_loss_clips_and_averages_over_all_tokens(bench):
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.0, 0.5, 0.0], [0.0, -0.5, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss = bench.ppo_clip_loss(new, old, adv, mask, clip=0.2, n_tokens=4.0)
    # row 0: ratio e^0.5 clipped to 1.2 (adv > 0) and ratio 1; row 1: ratio e^-0.5 clipped to 0.8 (adv < 0).
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 0.8) / 4.0)


def test_smoke_run_writes_its_json(bench, tmp_path):
    out = tmp_path / "r.json"
    result = bench.main([
        "--sft-steps", "5", "--sft-stop-at", "-1", "--sft-batch", "16", "--rl-steps", "2", "--prompts", "4",
        "--group", "2", "--eval-every", "1", "--n-train", "64", "--n-test", "16", "--json", str(out),
        "--threads", str(torch.get_num_threads()),  # main() sets torch's threads: keep this process's setting
    ])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["sft_steps_taken"] == 5 and [r["step"] for r in saved["log"]] == [0, 1, 2]
    assert saved["acc_after_rl"] == saved["log"][-1]["test_acc"]
    assert saved["gain_points"] == pytest.approx(round(100 * (saved["acc_after_rl"] - saved["acc_after_sft"]), 1))
