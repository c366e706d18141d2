"""`make gpu-check` (bench/gpu_check.py): its CPU-side part runs here and its table holds real figures.

The quick set (what `make test` runs: the model, vLLM's log-probs against the torch trainer in fp32 and
bf16, sleep/wake, the ``cuda_ipc`` class sharing weights into a running vLLM engine, the NCCL broadcast's
device frames packed and verified, trainer offload)
runs on CPU in its own processes; the FSDP and Megatron steps and the GRPO run of the full CPU set
are marked ``long`` (their engines have their own tests in `make test`). On GPUs the script is run by
hand (`make gpu-check`): docs/engines.md, "GPU check"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "gpu_check.py"
QUICK = ["model", "logprobs_fp32", "logprobs_bf16", "sleep_wake", "weight_ipc", "broadcast_frames", "trainer_offload"]


@pytest.fixture(scope="module")
def gpu_check(load_bench):
    return load_bench("gpu_check")


def _run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--cpu", "--out", str(out), *args], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    return {r["check"]: r for r in data["rows"]}, proc.stdout


def test_cpu_side_runs_every_quick_check_and_asserts_its_figures(tmp_path):
    rows, stdout = _run(tmp_path, "--quick")
    assert list(rows) == QUICK
    assert {r["device"] for r in rows.values()} == {"cpu"}
    assert [c for c, r in rows.items() if r["status"] != "ok"] == ["sleep_wake"]
    fp32, bf16 = rows["logprobs_fp32"]["figures"], rows["logprobs_bf16"]["figures"]
    assert fp32["tokens"] > 100 and fp32["mean_abs"] < 1e-4 and fp32["max_abs"] < 1e-3
    assert fp32["mean_abs"] < bf16["mean_abs"] < 0.1  # bf16 rounds: a gap fp32 does not have
    assert "no sleep mode" in rows["sleep_wake"]["reason"] and rows["sleep_wake"]["status"] == "skipped"
    ipc = rows["weight_ipc"]["figures"]
    assert ipc["sharing"] == "cpu" and ipc["engine"] == "vllm" and ipc["tensors"] > 0
    assert ipc["gap_after"] < 0.5 * ipc["gap_before"]  # vLLM now computes with the weights it was sent
    frames = rows["broadcast_frames"]["figures"]
    assert frames["tensors"] == ipc["tensors"] and frames["frames"] >= 1 and frames["gb"] > 0
    off = rows["trainer_offload"]["figures"]
    assert off["checksums_equal"] is True and off["offloaded_gb"] > 0
    assert rows["model"]["figures"]["params"] > 100_000
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(QUICK) and table[0].startswith("| check | device | status")


@pytest.mark.long
def test_full_cpu_side_trains_with_fsdp_megatron_and_runs_grpo(tmp_path):
    """Covered in `make test` by the engines' own tests (tests/engines/test_fsdp_engine.py,
    tests/megatron/, tests/runtime/test_e2e.py); here through the check script."""
    rows, _ = _run(tmp_path, "--only", "model,fsdp_step,megatron_step,grpo")
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["grpo"]["figures"]["steps"] == 3 and rows["grpo"]["figures"]["gen_tokens_per_s"] > 0


def test_unknown_checks_are_refused_with_the_known_ones(gpu_check, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "model,warp_drive"])
    assert "unknown check(s) warp_drive; checks: model, logprobs_fp32" in capsys.readouterr().err


def test_missing_packages_skip_their_checks_with_the_install_line(gpu_check):
    assert gpu_check._missing("torch") is None
    assert gpu_check._missing("vllm_that_is_not_there") == ("vllm_that_is_not_there is not installed here "
                                                            "(pip install vllm_that_is_not_there)")
    names = [c.name for c in gpu_check.CHECKS]
    assert names[0] == "model" and len(set(names)) == len(names)
    assert [c.name for c in gpu_check.CHECKS if c.quick] == QUICK


def test_table_has_one_row_per_check(gpu_check):
    rows = [gpu_check.Row("model", "cuda", "ok", {"params": 491_000_000, "random_init": True}, "", 12.5),
            gpu_check.Row("sleep_wake", "cpu", "skipped", {}, "vLLM on CPU has no sleep mode", 0.0)]
    lines = gpu_check.table(rows).splitlines()
    assert lines[2] == "| model | cuda | ok | params 491000000, random_init True | 12.5 |"
    assert lines[3] == "| sleep_wake | cpu | skipped | vLLM on CPU has no sleep mode | 0 |"


@pytest.mark.parametrize("default_missing", [False, True])
def test_the_grpo_check_flow_compiles_for_the_gpu_with_or_without_the_default_rollout_engine(
        gpu_check, tiny_model_dir, tmp_path, monkeypatch, default_missing):
    """The lent GPU machine may lack the default rollout engine's package (vLLM cannot be installed there):
    the GRPO check then rolls out with the first rollout engine whose package is installed; either flow
    must compile for an H200 with ``cuda_ipc`` resync."""
    from flowrl.catalog.engines import ENGINES, default_engine
    from flowrl.engines import registry
    from flowrl.launch import build_plan

    default, real = default_engine("rollout"), registry.missing_package
    monkeypatch.setattr(registry, "missing_package",
                        lambda spec: "absent" if default_missing and spec is default else real(spec))
    rollout = gpu_check.grpo_rollout("cuda")
    chosen = ENGINES[rollout.split("(")[0]]
    assert chosen.serves == "rollout" and real(chosen) is None and (chosen is default) != default_missing
    assert chosen.memory_option is None or f"{chosen.memory_option} = 0.4" in rollout
    flow = tmp_path / "grpo.flow"
    flow.write_text(gpu_check.GRPO_FLOW.format(
        model=json.dumps(tiny_model_dir), train=json.dumps(str(REPO / "data/arith/train.jsonl")), steps=30,
        batch=32, gpu=', gpu = "H200"', rollout=rollout, protocol="cuda_ipc"))
    plan = build_plan(str(flow), steps=30, save_every=0)
    (resync,) = plan.resyncs
    assert plan.cluster["gpu"] == "H200" and resync.protocol == "cuda_ipc"
    assert resync.reshard.dst.startswith(chosen.name + "(")


def test_the_offline_wheels_leave_out_only_the_unused_folders_and_their_record_lines(load_bench, tmp_path):
    """bench/gpu_wheels.py repacks Ray's wheel for a GPU machine without network: the folders flowrl
    never imports go, with their RECORD lines; every other entry keeps its bytes."""
    import zipfile

    wheels = load_bench("gpu_wheels")
    src, dst = tmp_path / "ray-1.0-py3-none-any.whl", tmp_path / "slim.whl"
    files = {"ray/__init__.py": b"x = 1\n", "ray/jars/ray_dist.jar": b"j" * 1000,
             "ray/dashboard/client/build/index.html": b"<html>", "ray/dashboard/head.py": b"# kept\n",
             "ray/rllib/algo.py": b"r" * 10}
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in files.items()) + "ray-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(src, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("ray-1.0.dist-info/RECORD", record)
    assert wheels.slim_wheel(src, dst, wheels.RAY_UNUSED) == 1000 + 6 + 10
    with zipfile.ZipFile(dst) as z:
        assert sorted(z.namelist()) == ["ray-1.0.dist-info/RECORD", "ray/__init__.py", "ray/dashboard/head.py"]
        assert z.read("ray/dashboard/head.py") == b"# kept\n"
        kept = z.read("ray-1.0.dist-info/RECORD").decode().splitlines()
    assert [line.split(",")[0] for line in kept] == ["ray/__init__.py", "ray/dashboard/head.py",
                                                     "ray-1.0.dist-info/RECORD"]
    assert all(p.startswith("ray/") and p.endswith("/") for p in wheels.RAY_UNUSED)
