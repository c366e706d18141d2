"""flowrl.models.warmstart: supervised warm start, greedy accuracy, and the on-disk cache."""

import hashlib
import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from flowrl.models import tiny
from flowrl.models.tiny import TinyModelError, load_tokenizer
from flowrl.models.warmstart import (
    SFTConfig,
    TinyModelConfig,
    WarmStartError,
    cache_key,
    encode_sft_batch,
    evaluate_accuracy,
    greedy_completions,
    sft_train,
    split_check_rows,
    teacher_forced_accuracy,
    warm_start,
)
from flowrl.tasks import get_task

SHORT = SFTConfig(steps=40, batch_size=32)
SMALL = TinyModelConfig(hidden=64, heads=2, kv_heads=1, intermediate=128)
"""Warm starts in tests: half-width model (its held-out evaluation, 400 greedy rows, is most of the time)."""


def test_encode_sft_batch_masks_prompt_and_padding(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    ids, attn, labels = encode_sft_batch(tok, [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+5=", "answer": "15"}])
    eos = tok.eos_token_id
    assert ids[0].tolist() == [1, 5, 14, 6, 16, 7, eos, 0, 0]
    assert ids[1].tolist() == [1, 5, 4, 14, 9, 16, 5, 9, eos]
    assert attn[0].tolist() == [1] * 7 + [0, 0]
    assert labels[0].tolist() == [-100] * 5 + [7, eos, -100, -100]
    assert labels[1].tolist() == [-100] * 6 + [5, 9, eos]


def test_encode_sft_batch_lays_out_an_episode_as_the_runtime_does(tiny_llama_dir):
    """Model turns end with EOS and carry labels; an observation is appended without special
    tokens and is masked, as in a multi-turn rollout's response mask."""
    tok = load_tokenizer(tiny_llama_dir)
    ids, attn, labels = encode_sft_batch(tok, [{"prompt": "1+2=", "turns": ["1+2", "3=", "3"]},
                                               {"prompt": "1+2=", "answer": "3"}])
    eos = tok.eos_token_id
    assert ids[0].tolist() == [1, 5, 14, 6, 16, 5, 14, 6, eos, 7, 16, 7, eos]
    assert labels[0].tolist() == [-100] * 5 + [5, 14, 6, eos, -100, -100, 7, eos]
    assert ids[1].tolist()[:7] == [1, 5, 14, 6, 16, 7, eos] and attn[1].tolist() == [1] * 7 + [0] * 6


def test_sft_lowers_the_loss_deterministically(tiny_llama_dir):
    rows = get_task("arith").rows("train")[:256]
    tok = load_tokenizer(tiny_llama_dir)
    runs = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        runs.append((sft_train(model, tok, rows, SFTConfig(steps=30, batch_size=32, stop_at_accuracy=None), seed=1), model))
    (losses, m1), (losses2, m2) = runs
    assert losses == losses2
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


# Rows every model learns in a few steps: one answer for all of them.
CONST = [{"prompt": f"{a}+{b}=", "answer": "7"} for a in range(4) for b in range(4)]


def test_sft_stops_at_the_first_check_that_reaches_the_target(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    cfg = SFTConfig(steps=200, batch_size=8, lr=3e-3, stop_at_accuracy=0.5, check_every=3, check_rows=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    taken = len(sft_train(model, tok, CONST, cfg, seed=3))
    assert taken % 3 == 0 and 3 <= taken < 200
    assert teacher_forced_accuracy(model, tok, CONST[:4]) >= 0.5
    # Replaying the same run (bit-reproducible; the check rows are not trained on) to each
    # earlier check: all below the target.
    for steps in range(3, taken, 3):
        replay = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        sft_train(replay, tok, CONST[4:], replace(cfg, steps=steps, stop_at_accuracy=None), seed=3)
        assert teacher_forced_accuracy(replay, tok, CONST[:4]) < 0.5, steps
    # Any accuracy is >= 0: training stops at the first check. An unreachable target: every step runs.
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert len(sft_train(model, tok, CONST, replace(cfg, stop_at_accuracy=0.0, check_every=10))) == 10
    assert len(sft_train(model, tok, CONST, replace(cfg, steps=12, stop_at_accuracy=1.01, check_every=5))) == 12


def test_teacher_forced_accuracy_equals_greedy_accuracy(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    rows = get_task("arith").rows("train")[:64]
    mixed = CONST[:8] + [{"prompt": r["prompt"], "answer": "7"} for r in rows[:24]] + rows[24:]
    sft_train(model, tok, CONST, SFTConfig(steps=6, batch_size=8, stop_at_accuracy=None), seed=0)
    # Partway through learning "7": some prompts give it, others not yet (both counts > 0).
    greedy = [t.strip() == r["answer"] for t, r in zip(greedy_completions(model, tok, [r["prompt"] for r in mixed], max_new_tokens=5), mixed)]
    assert 0 < sum(greedy) < len(mixed)
    assert teacher_forced_accuracy(model, tok, mixed) == sum(greedy) / len(mixed)
    assert teacher_forced_accuracy(model, tok, mixed, batch_size=7) == sum(greedy) / len(mixed)
    with pytest.raises(WarmStartError, match="no rows"):
        teacher_forced_accuracy(model, tok, [])


def test_sft_batch_larger_than_data_is_refused(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tok = load_tokenizer(tiny_llama_dir)
    with pytest.raises(WarmStartError, match="batch_size=64 exceeds the 3 training rows"):
        sft_train(model, tok, [{"prompt": "1+1=", "answer": "2"}] * 3, SFTConfig(batch_size=64, stop_at_accuracy=None))
    # The check's validation rows are not training rows: 16 rows less 12 leave 4 for a batch of 8.
    with pytest.raises(WarmStartError, match="batch_size=8 exceeds the 4 training rows"):
        sft_train(model, tok, CONST, SFTConfig(batch_size=8, check_rows=12))
    with pytest.raises(WarmStartError, match="check_rows=16 must .* leave rows to train on"):
        sft_train(model, tok, CONST, SFTConfig(batch_size=8, check_rows=16))


def test_the_stop_check_scores_rows_it_never_trains_on(tiny_llama_dir):
    """Training with a check that never stops takes the same steps as training without a
    check on the rows after the validation rows: the check rows are never sampled."""
    tok = load_tokenizer(tiny_llama_dir)
    rows = get_task("arith").rows("train")[:96]
    assert split_check_rows(rows, SFTConfig(check_rows=32)) == (rows[32:], rows[:32])
    assert split_check_rows(rows, SFTConfig(check_rows=32, stop_at_accuracy=None)) == (rows, [])
    checked = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    cfg = SFTConfig(steps=8, batch_size=16, stop_at_accuracy=1.01, check_every=2, check_rows=32)
    losses = sft_train(checked, tok, rows, cfg, seed=5)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert losses == sft_train(plain, tok, rows[32:], replace(cfg, stop_at_accuracy=None), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(checked.state_dict().values(), plain.state_dict().values()))


def test_evaluate_accuracy_counts_greedy_matches(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tok = load_tokenizer(tiny_llama_dir)
    prompts = ["12+35=", "1+1=", "99+99=", "7+0="]
    texts = greedy_completions(model, tok, prompts, max_new_tokens=4, batch_size=3)
    assert len(texts) == 4
    # Answers equal to the model's own greedy output: all right; otherwise: wrong.
    own = [{"prompt": p, "answer": t} for p, t in zip(prompts, texts)]
    assert evaluate_accuracy(model, own, tokenizer=tok, max_new_tokens=4) == 1.0
    half = own[:2] + [{"prompt": p, "answer": t + "0"} for p, t in zip(prompts[2:], texts[2:])]
    assert evaluate_accuracy(tiny_llama_dir, half, max_new_tokens=4) == 0.5
    with pytest.raises(WarmStartError, match="pass tokenizer="):
        evaluate_accuracy(model, own)


def test_warm_start_is_cached_by_key(tmp_path):
    first = warm_start("arith", model_cfg=SMALL, sft=SHORT, seed=0, cache_dir=tmp_path)
    assert not first.cached
    again = warm_start("arith", model_cfg=SMALL, sft=SHORT, seed=0, cache_dir=tmp_path)
    assert again.cached and again.path == first.path and again.info == first.info
    other = warm_start("arith", model_cfg=SMALL, sft=SHORT, seed=1, cache_dir=tmp_path)
    assert other.path != first.path
    info = json.loads((first.path / "warmstart.json").read_text())
    assert info["sft"]["steps"] == info["steps_taken"] == 40 and info["task"] == "arith" and 0.0 <= info["test_accuracy"] <= 1.0
    assert info["test_accuracy"] == evaluate_accuracy(first.path, get_task("arith").rows("test"), max_new_tokens=5)
    # No temp directories are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.path.name, other.path.name])


def test_cache_key_depends_on_every_input():
    base = cache_key("arith", TinyModelConfig(), SHORT, 0)[0]
    assert base == cache_key("arith", TinyModelConfig(), SHORT, 0)[0]
    assert base != cache_key("arith", TinyModelConfig(hidden=64, heads=2, kv_heads=1), SHORT, 0)[0]
    assert base != cache_key("arith", TinyModelConfig(), SFTConfig(steps=41, batch_size=32), 0)[0]
    assert base != cache_key("arith", TinyModelConfig(), SHORT, 1)[0]
    assert base != cache_key("arith", TinyModelConfig(), SFTConfig(steps=40, batch_size=32, stop_at_accuracy=0.4), 0)[0]
    assert base != cache_key("arith", TinyModelConfig(), SFTConfig(steps=40, batch_size=32, check_every=5), 0)[0]


def test_warm_start_is_bit_reproducible_and_seeded(tmp_path):
    digest = lambda d: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    before = torch.get_num_threads()
    try:
        # The caller's thread count does not reach the warm start (pinned to SFT_THREADS)...
        torch.set_num_threads(2)
        a = warm_start("arith", model_cfg=SMALL, sft=SHORT, seed=0, cache_dir=tmp_path / "a")
        assert torch.get_num_threads() == 2  # ...and is given back.
        torch.set_num_threads(1)
        b = warm_start("arith", model_cfg=SMALL, sft=SHORT, seed=0, cache_dir=tmp_path / "b")
    finally:
        torch.set_num_threads(before)
    assert not a.cached and not b.cached
    assert digest(a.path) == digest(b.path) and a.info == b.info
    # The seed sets the init and the data order: another seed, other weights.
    c = warm_start("arith", model_cfg=SMALL, sft=SHORT, seed=1, cache_dir=tmp_path / "a")
    assert digest(c.path) != digest(a.path) and c.info["seed"] == 1


def test_tiny_model_source(tmp_path):
    path = tiny("arith", warm=False, seed=2, cache_dir=tmp_path, hidden=64, heads=2, kv_heads=1, intermediate=128)
    info = json.loads((path / "warmstart.json").read_text())
    assert info["sft"]["steps"] == 0 and info["model"]["hidden"] == 64
    assert AutoModelForCausalLM.from_pretrained(path).config.hidden_size == 64
    assert tiny("arith", warm=False, seed=2, cache_dir=tmp_path, hidden=64, heads=2, kv_heads=1, intermediate=128) == path
    with pytest.raises(TinyModelError, match=r"unknown option\(s\) \['width'\]"):
        tiny("arith", width=3, cache_dir=tmp_path)


def test_the_run_seed_reaches_the_warm_start(tmp_path, monkeypatch):
    """`flowrl run --set seed=N` seeds the tiny model's init and SFT data order too (plus
    `tiny(seed = ...)` as an offset), and the warm-start cache keeps one entry per seed."""
    from flowrl.launch import build_plan
    from flowrl.runtime.materialize import materialize_models

    data = get_task("arith").data_dir
    flow = tmp_path / "seeded.flow"
    flow.write_text(f"""import stdlib.grpo
model a = tiny(task = "arith", warm_start = 0, hidden = 64, heads = 2, kv_heads = 1)
model b = tiny(task = "arith", warm_start = 0, hidden = 64, heads = 2, kv_heads = 1, seed = 10)
dataset d = jsonl("{data / 'train.jsonl'}")
reward r = verifier("math")
flow main(seed: int = 0) {{
  grpo(a, d, r, batch = 4, group = 2, max_tokens = 5)
  grpo(b, d, r, batch = 4, group = 2, max_tokens = 5)
}}
""")
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    seeds = {}
    for run_seed in (0, 1):
        plan = build_plan(str(flow), sets={"seed": str(run_seed)})
        assert plan.run.seed == run_seed
        paths = materialize_models(plan, log=lambda msg: None)
        seeds[run_seed] = {m: json.loads((paths[m] / "warmstart.json").read_text())["seed"] for m in ("a", "b")}
    assert seeds == {0: {"a": 0, "b": 10}, 1: {"a": 1, "b": 11}}
    assert len(list((tmp_path / "cache" / "warmstart").iterdir())) == 4


def test_the_drivers_tokenizer_is_what_auto_tokenizer_loads(tmp_path, monkeypatch):
    """A run's driver loads a tiny model's tokenizer without transformers' model registry (the plain fast
    class its config names), and finds a cached warm start without importing flowrl.models; the tokenizer is
    the one AutoTokenizer loads: same class, special tokens, padding side and ids."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from flowrl.launch import build_plan
    from flowrl.runtime.materialize import load_tokenizer_for, materialize_models, tokenizer_class

    flow = tmp_path / "t.flow"
    flow.write_text(f"""import stdlib.grpo
model a = tiny(task = "arith", warm_start = 0, hidden = 64, heads = 2, kv_heads = 1)
dataset d = jsonl("{get_task('arith').data_dir / 'train.jsonl'}")
reward r = verifier("math")
flow main() {{
  grpo(a, d, r, batch = 4, group = 2, max_tokens = 5)
}}
""")
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    plan = build_plan(str(flow))
    paths = materialize_models(plan, log=lambda msg: None)  # built here; the driver below finds it cached
    assert tokenizer_class(paths["a"]) in ("TokenizersBackend", "PreTrainedTokenizerFast")
    light, auto = load_tokenizer_for(plan, paths), AutoTokenizer.from_pretrained(str(paths["a"]))
    assert type(light) is type(auto) and light.special_tokens_map == auto.special_tokens_map
    assert light.padding_side == auto.padding_side and light.get_vocab() == auto.get_vocab()
    texts = ["12+34=", "7+8=15", "9"]
    assert light(texts).input_ids == auto(texts).input_ids
    assert tokenizer_class(tmp_path) is None  # no config: AutoTokenizer decides
    code = ("import sys; from flowrl.launch import build_plan; "
            "from flowrl.runtime.materialize import load_tokenizer_for, materialize_models; "
            f"plan = build_plan({str(flow)!r}); load_tokenizer_for(plan, materialize_models(plan, log=print)); "
            "print(sorted(m for m in ('flowrl.models', 'sympy', 'transformers.models.auto.auto_factory') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "FLOWRL_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_tiny_and_its_reward_model_take_the_shape_the_compiler_plans():
    """`tiny` and `tiny_rm` build their model by the catalogue's rule: the flow's options over the
    task's own shape (a reward model of the longtail task is as wide as its policy)."""
    from flowrl.catalog.models import tiny_shape
    from flowrl.runtime.materialize import _tiny_config

    for attrs in ({"task": "longtail"}, {"task": "arith", "hidden": 64, "arch": "qwen3"}):
        cfg = _tiny_config(attrs)
        assert {k: getattr(cfg, k) for k in tiny_shape(attrs)} == tiny_shape(attrs)
    assert _tiny_config({"task": "longtail"}).hidden == 512
    assert _tiny_config({"task": "arith", "arch": "qwen3"}).arch == "qwen3"
