"""bench/e2e_vs_trl.py's longtail mode: its settings, the flows it writes (the synchronous one and
`schedule auto`'s compile; auto picks an asynchronous schedule) and its time-to-accuracy rule."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("e2e_vs_trl")


def test_longtail_settings_and_arith_defaults_unchanged(bench):
    cfg = bench.parse_args(["--task", "longtail", "--quick", "--target", "0.4"])[0]
    assert (cfg.task, cfg.verifier, cfg.max_tokens, cfg.eval_every, cfg.target) == ("longtail", "final", 344, 5, 0.4)
    assert cfg.variants == (("vllm", 1), ("auto", 0))
    assert bench.parse_args(["--task", "longtail"])[0].target_gain == 0.05  # over the warm start, once it is known
    assert [v.flowrl_name for v in cfg.flowrl_variants()] == ["flowrl", "flowrl auto"]
    cfg.check()
    arith = bench.parse_args([])[0]
    assert (arith.task, arith.steps, arith.batch, arith.max_tokens, arith.target) == ("arith", 60, 64, 5, None)
    with pytest.raises(bench.BenchError, match="--eval-every 4 must be >= 0 and divide --steps 10"):
        bench.parse_args(["--task", "longtail", "--quick", "--eval-every", "4"])[0].check()


def test_time_to_target_counts_start_up_and_steps_up_to_the_first_crossing(bench):
    side = bench.SideResult("x", startup_s=10.0, step_s=[1.0, 2.0, 3.0, 4.0], rewards=[0.0] * 4, gen_tokens=[1] * 4,
                            acc_curve={0: 0.2, 2: 0.25, 4: 0.5})
    assert side.time_to(0.3) == (4, 20.0)
    assert side.time_to(0.25) == (2, 13.0)
    assert side.time_to(0.9) == (None, None) and side.time_to(None) == (None, None)


def test_written_flows_compile_and_auto_is_asynchronous(bench, tmp_path):
    from flowrl.launch import build_plan

    cfg = bench.parse_args(["--task", "longtail", "--quick", "--max-tokens", "64"])[0]
    model = tmp_path / "model"
    from flowrl.models.tiny import build_tiny_model
    from flowrl.tasks import get_task

    build_tiny_model(model, chars=get_task("longtail").chars, hidden=64, heads=2, kv_heads=1, max_position=128)
    got = {}
    assert cfg.micro_batch_tokens == 2048  # flowrl's update by a token budget (TRL has none)
    for v in cfg.flowrl_variants():
        flow = bench.write_flow(v, model, ROOT / "data" / "longtail" / "train.jsonl", tmp_path / f"{v.rollout}.flow")
        plan = build_plan(str(flow), steps=v.steps, save_every=v.eval_every)
        update = next(op for op in plan.ops if op.id.endswith("update"))
        assert update.options["micro_batch_tokens"] == 2048
        got[v.flowrl_name] = bench.schedule_summary(plan)
    assert got["flowrl"]["staleness"] == 1 and not got["flowrl"]["auto"]
    assert got["flowrl auto"]["auto"] and got["flowrl auto"]["staleness"] >= 2
