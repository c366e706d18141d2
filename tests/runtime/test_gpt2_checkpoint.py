"""An ``hf(dir)`` GPT-2 checkpoint runs: its context comes from ``n_positions``, its train and
rollout log-probs agree.

GPT-2 names its maximum positions ``n_positions`` (Llama: ``max_position_embeddings``): the
rollout engine's context is read under either name (``flowrl.catalog.models.max_positions``),
else vLLM refused to start (max_model_len 2048 > 64). GPT-2 configs also ship dropouts of 0.1:
the train engine turns dropout off, else its log-probs were 0.07 nats off vLLM's.
The checkpoint is built here (transformers ``GPT2Config``, random weights, a character-level
tokenizer), 0.3M parameters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def build_tiny_gpt2(out: Path, n_positions: int = 64) -> Path:
    """A GPT-2 checkpoint (config, safetensors, tokenizer): 2 layers, 128 wide, head_dim 32 (vLLM's CPU minimum)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from flowrl.models.tiny import build_tokenizer

    tok = build_tokenizer("0123456789+-=")
    cfg = GPT2Config(vocab_size=len(tok), n_embd=128, n_layer=2, n_head=4, n_positions=n_positions,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.1  # GPT-2's defaults: dropout on
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).float()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "model")


def test_train_engine_runs_gpt2_without_dropout(gpt2):
    """The engine is in train mode (it trains), yet its log-probs are the model's eval-mode ones."""
    from transformers import AutoModelForCausalLM

    from flowrl.engines.torch_train import TorchTrainEngine
    from flowrl.engines.types import TokenBatch

    engine = TorchTrainEngine(str(gpt2))
    assert engine.model.training
    ids = torch.tensor([[1, 6, 3, 14, 7, 10, 16, 14, 2], [1, 5, 14, 11, 16, 12, 2, 0, 0]])
    mask = (torch.arange(9) < torch.tensor([[9], [7]])).long()
    batch = TokenBatch(ids, mask, mask.float())
    a, b = engine.forward(batch)["logprobs"], engine.forward(batch)["logprobs"]
    assert torch.equal(a, b)  # no dropout noise between two forwards
    ref = AutoModelForCausalLM.from_pretrained(str(gpt2), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = ref(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
    expected = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
    # Same fp32 operations in the same order: equal to float rounding (a few ulp of values ~3).
    assert torch.allclose(a[:, 1:] * mask[:, 1:], expected, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.long  # make test-long; in make test: the compiler's facts (tests/compiler/test_check_resources.py)
@pytest.mark.timeout(900)  # and vLLM on a GPT-2 checkpoint (tests/families/test_family_logprobs.py)
def test_flowrl_run_one_step_of_gpt2_on_vllm(gpt2, tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    from flowrl.tasks.arith import make_split

    rows = make_split(40, 3)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[32:]))
    (tmp_path / "gpt2.flow").write_text(f"""import stdlib.grpo
model policy = hf("{gpt2}")
dataset arith = jsonl("train.jsonl", eval = "test.jsonl")
reward exact = verifier("math")
flow main(steps: int = 1) {{
  grpo(policy, arith, exact, batch = 4, group = 2, max_tokens = 8, lr = 1e-3, kl = 0.0)
}}
""")
    script = Path(sys.executable).parent / "flowrl"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "flowrl.cli"]
    check = subprocess.run(cmd + ["check", "gpt2.flow"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    run = subprocess.run(cmd + ["run", "gpt2.flow", "--steps", "1", "--out", "out"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if m.get("step") == 1)
    # vLLM's sampler log-probs vs the trainer's, same weights, fp32: float rounding only.
    assert step["mismatch/abs_max"] < 1e-4, step
