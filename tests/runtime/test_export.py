"""flowrl export: a run's checkpoint out as a Hugging Face directory that transformers, vLLM and PEFT load,
for each train engine's layout (torch, FSDP dp = 2, Megatron tp = 2) and for a dense model, a mixture of
experts and LoRA (adapter directory and merged); the exported model's log-probs equal the trainer's.

Each case trains the real engine 3 steps, saves it into a run directory as the driver does (the run's
``plan.json`` from the flow, ``checkpoints/step_000003/policy/`` written atomically with its manifest),
and exports it. Tolerance 1e-4 (fp32, the issue's bound): transformers reads the very tensors the trainer
holds (measured exactly equal), vLLM computes with its own CPU kernels (a few 1e-6 nats).
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from engine_testkit import random_batch, sft_loss  # noqa: E402

from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine  # noqa: E402
from flowrl.engines.types import SamplingSpec, TokenBatch  # noqa: E402
from flowrl.runtime.checkpoints import checkpoint_dir, write_checkpoint  # noqa: E402
from flowrl.runtime.export import READERS, ExportError, export_run  # noqa: E402

TOL = 1e-4
OPTIM = OptimConfig(lr=1e-2, max_grad_norm=1.0)
VOCAB = 17  # build_tiny_model's default characters + 4 specials
LORA = 'lora = lora(r = 4, alpha = 8, targets = ["q_proj", "v_proj", "down_proj"])'


def _workdir(tmp: Path, arch: str = "llama", lora: bool = False, schedule: str = "") -> Path:
    """``tmp`` with a tiny model of ``arch``, a dataset and a flow training it: what a run is made of."""
    from flowrl.models.tiny import build_tiny_model
    from flowrl.tasks.arith import make_split

    build_tiny_model(tmp / "model", arch=arch, seed=0)
    split = make_split(20, 7)
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split[:16]))
    (tmp / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split[16:]))
    model = f'hf("model", {LORA})' if lora else 'hf("model")'
    (tmp / "f.flow").write_text(f"""import stdlib.grpo
model policy = {model}
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl")
reward exact = verifier("math")
flow main(steps: int = 3, eval_every: int = 0) {{
  grpo(policy, prompts, exact, batch = 4, group = 2, max_tokens = 4)
}}
{schedule}""")
    return tmp


def _run_dir(work: Path, engine, step: int = 3) -> Path:
    """A run directory as ``flowrl run`` leaves it: the plan, and ``engine``'s state after ``step`` steps."""
    from flowrl.launch import build_plan

    plan = build_plan(str(work / "f.flow"))
    run = work / "run"
    run.mkdir()
    (run / "plan.json").write_text(plan.to_json())
    write_checkpoint(checkpoint_dir(run, step), lambda tmp: engine.save(str(tmp / "policy")))
    return run


def _train(engine, steps: int = 3) -> None:
    for s in range(steps):
        engine.train_step(random_batch(8, seed=100 + s, vocab=VOCAB), sft_loss, micro_batch_size=4)


def _hf_logprobs(model, batch: TokenBatch) -> torch.Tensor:
    """log p(token t | tokens < t) of a transformers model, aligned as a train engine's (0 at position 0)."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    out = torch.zeros(batch.input_ids.shape)
    out[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return out * batch.attention_mask


def _gap(a: torch.Tensor, b: torch.Tensor, batch: TokenBatch) -> float:
    mask = batch.attention_mask.bool().clone()
    mask[:, 0] = False
    return float((a - b)[mask].abs().max())


def _check_model_dir(out: Path, trainer, base: Path, shards: bool = False) -> None:
    """``out`` loads in transformers with the trainer's log-probs (and not the base model's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names, names
    assert ("model.safetensors.index.json" in names) == shards, names
    batch = random_batch(6, seed=9, vocab=VOCAB)
    want = trainer.forward(batch)["logprobs"]
    got = _hf_logprobs(AutoModelForCausalLM.from_pretrained(str(out)), batch)
    assert _gap(got, want, batch) <= TOL
    assert _gap(_hf_logprobs(AutoModelForCausalLM.from_pretrained(str(base)), batch), want, batch) > 1e-3  # it trained
    assert AutoTokenizer.from_pretrained(str(out)).encode("1+2=") == AutoTokenizer.from_pretrained(str(base)).encode("1+2=")


def _check_vllm(out: Path, trainer) -> None:
    """vLLM loads ``out`` from disk; the log-probs of the tokens it samples equal the trainer's."""
    pytest.importorskip("vllm")
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    rollout = VLLMRolloutEngine(str(out), dtype="float32", max_model_len=64)
    try:
        groups = rollout.generate([[1, 5 + i, 14, 6] for i in range(4)], SamplingSpec(n=2, max_tokens=8, seed=3))
    finally:
        rollout.shutdown()
    batch = TokenBatch.from_completions([c for g in groups for c in g], pad_id=0)
    mask = batch.response_mask.bool()
    assert int(mask.sum()) > 20
    gap = (trainer.forward(batch)["logprobs"] - batch.extras["rollout_logprobs"])[mask].abs().max()
    assert float(gap) <= TOL, float(gap)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gpt2"])
def test_torch_checkpoint_exports_for_transformers_and_vllm(arch, tmp_path):
    """A dense family, the mixture of experts, and GPT-2 (its LM head tied to the embedding: written once)."""
    work = _workdir(tmp_path, arch)
    trainer = TorchTrainEngine(str(work / "model"), optim=OPTIM)
    _train(trainer)
    run = _run_dir(work, trainer)
    done = export_run(run, tmp_path / "out", max_shard_bytes=200_000)
    assert (done.kind, done.step, done.model) == ("model", 3, "policy")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    if arch == "qwen3_moe":  # the experts one tensor each, as the family's checkpoints (and vLLM) name them
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in index["weight_map"]
    _check_model_dir(tmp_path / "out", trainer, work / "model", shards=True)
    if arch == "gpt2":
        assert "lm_head.weight" not in index["weight_map"]
        return  # its vLLM round trip: tests/families/test_family_logprobs.py (the resync's tensors are these)
    _check_vllm(tmp_path / "out", trainer)


@pytest.mark.slow
def test_lora_exports_a_peft_adapter_and_merged_weights(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    work = _workdir(tmp_path, lora=True)
    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj", "down_proj"]}
    trainer = TorchTrainEngine(str(work / "model"), optim=OPTIM, lora=lora)
    _train(trainer)
    run = _run_dir(work, trainer)
    adapter = export_run(run, tmp_path / "adapter")
    assert adapter.kind == "adapter"
    names = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names and "config.json" not in names
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(lora["targets"]))
    base = AutoModelForCausalLM.from_pretrained(str(work / "model"))
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    batch = random_batch(6, seed=9, vocab=VOCAB)
    want = trainer.forward(batch)["logprobs"]
    assert _gap(_hf_logprobs(peft_model, batch), want, batch) <= TOL

    merged = export_run(run, tmp_path / "merged", merge_lora=True)
    assert merged.kind == "model"
    assert not any("lora" in k for k in _tensor_names(tmp_path / "merged"))
    _check_model_dir(tmp_path / "merged", trainer, work / "model")
    _check_vllm(tmp_path / "merged", trainer)


def _tensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names += list(st.keys())
    return names


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp_dp2_checkpoint_is_gathered(lora, tmp_path):
    """FSDP's sharded checkpoint, read whole; with LoRA it holds the adapters alone (merged on export)."""
    from flowrl.engines.fsdp import FsdpTrainEngine

    work = _workdir(tmp_path, lora=lora, schedule="""schedule main on cluster(nodes = 1, gpus_per_node = 2) {
  policy.train = fsdp(dp = 2)
}""")
    adapters = {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj", "down_proj"]} if lora else None
    trainer = FsdpTrainEngine(str(work / "model"), optim=OPTIM, dp=2, threads=1, lora=adapters)
    try:
        _train(trainer)
        run = _run_dir(work, trainer)
        export_run(run, tmp_path / "out", merge_lora=lora)
        _check_model_dir(tmp_path / "out", trainer, work / "model")
    finally:
        trainer.shutdown()


MEGATRON = [pytest.param("llama", {"tp": 2}, id="tp2"),
            pytest.param("llama", {"pp": 2}, id="pp2", marks=pytest.mark.long),
            pytest.param("qwen3_moe", {"dp": 2, "ep": 2}, id="moe-ep2", marks=pytest.mark.long)]
"""Megatron layouts: tensor-parallel shards (in ``make test``); pipeline stages and expert-parallel ranks
(``long``: ~50 s each, two more rank processes): each gathered into one transformers checkpoint."""


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", MEGATRON)
def test_megatron_checkpoint_is_gathered_to_transformers_names(arch, layout, tmp_path):
    pytest.importorskip("megatron.core")
    from flowrl.engines.megatron import MegatronTrainEngine

    written = ", ".join(f"{k} = {v}" for k, v in layout.items())
    work = _workdir(tmp_path, arch, schedule=f"""schedule main on cluster(nodes = 1, gpus_per_node = 2) {{
  policy.train = megatron({written})
}}""")
    trainer = MegatronTrainEngine(str(work / "model"), optim=OPTIM, threads=1, **layout)
    try:
        _train(trainer)
        run = _run_dir(work, trainer)
        assert len(list((run / "checkpoints" / "step_000003" / "policy").glob("mp_rank_*.pt"))) == 2
        export_run(run, tmp_path / "out")
        _check_model_dir(tmp_path / "out", trainer, work / "model")
    finally:
        trainer.shutdown()


# ---- a run directory is untrusted data: clear one-line errors, nothing executed -------------------


class _Boom:
    def __reduce__(self):
        return (print, ("EXECUTED",))


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    work = _workdir(tmp_path_factory.mktemp("export_run"))
    trainer = TorchTrainEngine(str(work / "model"), optim=OPTIM)
    _train(trainer, 1)
    return _run_dir(work, trainer, step=1)


def test_errors_name_the_problem(torch_run, tmp_path):
    with pytest.raises(ExportError, match="no plan.json there"):
        export_run(tmp_path, tmp_path / "o1")
    with pytest.raises(ExportError, match="no checkpoint of that step; there are: 1"):
        export_run(torch_run, tmp_path / "o2", step=7)
    with pytest.raises(ExportError, match="--model ref: the run trains no such policy; it trains: policy"):
        export_run(torch_run, tmp_path / "o3", model="ref")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    with pytest.raises(ExportError, match="not empty"):
        export_run(torch_run, tmp_path / "full")
    assert (tmp_path / "full" / "mine.txt").read_text() == "x"


def test_a_replaced_state_file_is_refused_unread(torch_run, tmp_path, capfd):
    import shutil

    from flowrl.runtime.checkpoints import MANIFEST, write_checkpoint as rewrite

    run = tmp_path / "run"
    shutil.copytree(torch_run, run)
    ckpt = run / "checkpoints" / "step_000001"
    # a pickle that would run code, with a manifest recomputed to match (a manifest is no signature)
    (ckpt / "policy" / "engine_state.pt").write_bytes(pickle.dumps({"model": _Boom()}))
    (ckpt / MANIFEST).unlink()
    tmp = ckpt.with_name("step_000001.new")
    ckpt.rename(tmp)
    rewrite(ckpt, lambda d: shutil.copytree(tmp / "policy", d / "policy"))
    with pytest.raises(ExportError, match="engine_state.pt is not an engine checkpoint this flowrl wrote") as e:
        export_run(run, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert "EXECUTED" not in capfd.readouterr().out
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_a_damaged_checkpoint_is_refused(torch_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(torch_run, run)
    state = run / "checkpoints" / "step_000001" / "policy" / "engine_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="is damaged: policy/engine_state.pt has CRC-32"):
        export_run(run, tmp_path / "out")


def test_readers_are_keyed_by_each_engines_own_file():
    from flowrl.engines.fsdp import META_FILE as FSDP
    from flowrl.engines.megatron.engine import META_FILE as MEGATRON
    from flowrl.engines.torch_train import STATE_FILE

    assert [name for name, _ in READERS] == [STATE_FILE, FSDP, MEGATRON]


def test_the_command_line(torch_run, tmp_path, capsys):
    from flowrl.cli import main

    assert main(["export", str(torch_run), "--to", str(tmp_path / "out"), "--max-shard-size", "100KB"]) == 0
    said = capsys.readouterr()
    assert "exported `policy` after step 1 to" in said.out and "model.safetensors.index.json" in said.out
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    assert main(["export", str(torch_run), "--to", str(tmp_path / "m"), "--merge-lora"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flowrl: error: --merge-lora: model `policy` trains no LoRA adapters") and err.count("\n") == 1
    assert main(["export", str(torch_run), "--to", str(tmp_path / "x"), "--max-shard-size", "big"]) == 1
    assert "--max-shard-size 'big': give a size such as 5GB" in capsys.readouterr().err


def test_nothing_but_the_target_is_touched(torch_run, tmp_path):
    (tmp_path / "out.tmp").mkdir()
    (tmp_path / "out.tmp" / "mine.txt").write_text("x")
    with pytest.raises(ExportError, match=r"out.tmp exists \(an earlier export cut short, or not flowrl's\)"):
        export_run(torch_run, tmp_path / "out")
    assert (tmp_path / "out.tmp" / "mine.txt").read_text() == "x" and not (tmp_path / "out").exists()


def test_a_run_replaces_its_own_export_of_a_step_and_nothing_else(torch_run, tmp_path):
    import shutil

    from flowrl.runtime import rundir
    from flowrl.runtime.export import export_in_run, read_plan

    run = tmp_path / "run"
    shutil.copytree(torch_run, run)
    rundir.start(run)
    ckpt = run / "checkpoints" / "step_000001"
    first = export_in_run(read_plan(run), run, ckpt)
    assert first == [run / "exports" / "step_000001"] and rundir.listed(run)["exports/step_000001"] == rundir.PATH
    assert export_in_run(read_plan(run), run, ckpt) == first  # resumed and exported again: replaced
    foreign = run / "exports" / "step_000001.tmp"
    foreign.mkdir()
    rundir.start(run)  # a list that no longer names it
    with pytest.raises(ExportError, match="step_000001 exists and flowrl did not write it"):
        export_in_run(read_plan(run), run, ckpt)
    assert foreign.is_dir()
