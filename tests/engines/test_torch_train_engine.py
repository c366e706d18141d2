"""TorchTrainEngine: per-token outputs, micro-batch exactness, schedule, clipping, critic, save/load."""

from __future__ import annotations

import pytest
import torch
from engine_testkit import make_trainer, random_batch, sft_loss, train_a_few_steps, value_loss
from safetensors.torch import load_file

from flowrl.engines.base import EngineConfigError, EngineError, TrainEngine
from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine, trim_padding


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.named_weights()}


def test_is_a_train_engine(tiny_model_dir):
    assert isinstance(make_trainer(tiny_model_dir), TrainEngine)


def test_forward_logprobs_and_entropy_match_manual_computation(tiny_model_dir):
    engine = make_trainer(tiny_model_dir, temperature=0.7)
    batch = random_batch(5, seed=1)
    out = engine.forward(batch, entropy=True)
    assert out["logprobs"].shape == batch.input_ids.shape == out["entropy"].shape
    assert out["logprobs"].dtype == torch.float32

    with torch.no_grad():
        logits = engine.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / 0.7
    for b in range(batch.size):
        n = int(batch.attention_mask[b].sum())
        logp = torch.log_softmax(logits[b, : n - 1], dim=-1)
        expected = logp.gather(-1, batch.input_ids[b, 1:n, None]).squeeze(-1)
        torch.testing.assert_close(out["logprobs"][b, 1:n], expected, atol=1e-5, rtol=0)
        ent = -(logp.exp() * logp).sum(-1)
        torch.testing.assert_close(out["entropy"][b, 1:n], ent, atol=1e-5, rtol=0)
        # Position 0 has no prediction; padding carries nothing.
        assert out["logprobs"][b, 0] == 0 and (out["logprobs"][b, n:] == 0).all()
        assert (out["entropy"][b, n:] == 0).all()


def test_forward_in_micro_batches_equals_one_pass(tiny_model_dir):
    engine = make_trainer(tiny_model_dir)
    batch = random_batch(7, seed=2)
    whole = engine.forward(batch, entropy=True)
    parts = engine.forward(batch, entropy=True, micro_batch_size=2)
    # Micro-batches are padded to their own lengths, so matmuls run with other shapes and
    # BLAS kernels sum in another order: fp32 rounding (eps 1.2e-7) accumulated over a
    # hidden-128 dot product and a 43-way log-softmax of logits ~10 is ~1e-6 (1.9e-6 seen on
    # one AMD CPU). 1e-5 absolute + relative bounds that with margin and still catches a
    # wrong row, mask or position (errors of order 0.1-1).
    for key in whole:
        torch.testing.assert_close(parts[key], whole[key], atol=1e-5, rtol=1e-5)


def test_micro_batching_is_exact(tiny_model_dir):
    """One step on the whole batch == the same step accumulated over micro-batches."""
    batch = random_batch(8, seed=3)
    # AdamW's first update is lr * g / (|g| + eps): with the default eps=1e-8, gradient
    # entries near 1e-8 turn float-rounding differences into O(lr) parameter changes.
    # A larger eps keeps the update a smooth function of the gradient.
    optim = OptimConfig(lr=1e-2, eps=1e-3)
    big, small = make_trainer(tiny_model_dir, optim=optim), make_trainer(tiny_model_dir, optim=optim)
    m_big = big.train_step(batch, sft_loss, micro_batch_size=8)
    m_small = small.train_step(batch, sft_loss, micro_batch_size=3)  # 3+3+2 rows, different paddings
    assert m_small["loss"] == pytest.approx(m_big["loss"], abs=1e-6)
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], abs=1e-6)
    grads_big = {n: p.grad for n, p in big.model.named_parameters()}
    for name, p in small.model.named_parameters():
        torch.testing.assert_close(p.grad, grads_big[name], atol=1e-6, rtol=0)
    after_big = _params(big)
    for name, tensor in small.named_weights():
        # The update's slope in g is at most lr / eps = 10: gradients within 1e-6 (above) give
        # weights within 1e-5.
        torch.testing.assert_close(tensor, after_big[name], atol=1e-5, rtol=0)


def test_loss_decreases_and_metrics_are_reported(tiny_model_dir):
    engine = make_trainer(tiny_model_dir)
    batch = random_batch(8, seed=4)
    losses = [engine.train_step(batch, sft_loss, micro_batch_size=4)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.5  # lr 1e-2 memorises a fixed batch quickly
    metrics = engine.train_step(batch, sft_loss, micro_batch_size=4)
    assert metrics["step"] == 6 and metrics["lr"] == pytest.approx(1e-2) and metrics["skipped"] == 0
    assert metrics["grad_norm"] > 0


def test_loss_fn_metrics_are_summed_over_micro_batches(tiny_model_dir):
    engine = make_trainer(tiny_model_dir)
    batch = random_batch(6, seed=5)

    def loss_with_metrics(outputs, micro, denominator):
        tokens = micro.response_mask.sum() / denominator["tokens"]
        rows = torch.tensor(micro.size / denominator["sequences"])
        return sft_loss(outputs, micro, denominator), {"token_frac": tokens, "row_frac": rows}

    metrics = engine.train_step(batch, loss_with_metrics, micro_batch_size=4)
    assert metrics["token_frac"] == pytest.approx(1.0) and metrics["row_frac"] == pytest.approx(1.0)


def test_warmup_schedule(tiny_model_dir):
    engine = make_trainer(tiny_model_dir, optim=OptimConfig(lr=0.1, warmup_steps=4))
    lrs = [engine.train_step(random_batch(2, seed=s), sft_loss, micro_batch_size=2)["lr"] for s in range(6)]
    assert lrs == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])


def test_grad_clipping_bounds_the_applied_gradient(tiny_model_dir):
    engine = make_trainer(tiny_model_dir, optim=OptimConfig(lr=1e-3, max_grad_norm=0.05))
    metrics = engine.train_step(random_batch(4, seed=6), sft_loss, micro_batch_size=2)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in engine.model.parameters()]))
    assert metrics["grad_norm"] > 1.0  # reported before clipping
    assert float(clipped) == pytest.approx(0.05, rel=1e-4)


def test_adamw_hyperparameters_reach_the_optimizer(tiny_model_dir):
    optim = OptimConfig(lr=3e-4, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-6)
    group = make_trainer(tiny_model_dir, optim=optim).optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"], group["eps"]) == (3e-4, (0.8, 0.95), 0.1, 1e-6)


def test_named_weights_use_transformers_checkpoint_names(tiny_model_dir):
    checkpoint = load_file(f"{tiny_model_dir}/model.safetensors")
    exported = dict(make_trainer(tiny_model_dir).named_weights())
    assert sorted(exported) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0)


def test_critic_values(tiny_model_dir):
    critic = TorchTrainEngine(tiny_model_dir, role="critic", optim=OptimConfig(lr=1e-2), seed=3)
    batch = random_batch(5, seed=7)
    values = critic.forward(batch, values=True)["values"]
    assert values.shape == batch.input_ids.shape and values.dtype == torch.float32
    lengths = batch.attention_mask.sum(1)
    for b in range(batch.size):
        assert values[b, 0] == 0 and (values[b, int(lengths[b]) :] == 0).all()
        assert (values[b, 1 : int(lengths[b])] != 0).all()
    names = [n for n, _ in critic.named_weights()]
    assert names[-2:] == ["value_head.weight", "value_head.bias"] and "lm_head.weight" not in names

    batch.extras["returns"] = torch.ones_like(batch.response_mask)
    losses = [critic.train_step(batch, value_loss, micro_batch_size=2)["loss"] for _ in range(8)]
    assert losses[-1] < 0.2 * losses[0]

    # The value head's init is seeded: same seed, same values.
    again = TorchTrainEngine(tiny_model_dir, role="critic", seed=3).forward(random_batch(5, seed=7), values=True)
    other = TorchTrainEngine(tiny_model_dir, role="critic", seed=4).forward(random_batch(5, seed=7), values=True)
    assert torch.equal(again["values"], values) and not torch.equal(other["values"], values)


def test_save_load_resumes_bit_identically(tiny_model_dir, tmp_path):
    optim = OptimConfig(lr=1e-2, warmup_steps=3, weight_decay=0.01)
    first = make_trainer(tiny_model_dir, optim=optim)
    train_a_few_steps(first, steps=2)
    first.save(str(tmp_path / "ckpt"))
    expected_metrics = first.train_step(random_batch(8, seed=42), sft_loss, micro_batch_size=4)
    expected = _params(first)

    resumed = make_trainer(tiny_model_dir, optim=optim)
    resumed.load(str(tmp_path / "ckpt"))
    metrics = resumed.train_step(random_batch(8, seed=42), sft_loss, micro_batch_size=4)
    assert metrics == expected_metrics  # same loss, grad norm, lr and step count, bit for bit
    for name, tensor in resumed.named_weights():
        assert torch.equal(tensor, expected[name]), name


def test_load_restores_rng_state(tiny_model_dir, tmp_path):
    engine = make_trainer(tiny_model_dir)
    torch.manual_seed(123)
    engine.save(str(tmp_path / "ckpt"))
    expected = torch.rand(4)
    engine.load(str(tmp_path / "ckpt"))
    assert torch.equal(torch.rand(4), expected)


def test_trim_padding_drops_only_all_padding_columns():
    batch = random_batch(4, seed=8)
    batch.extras["advantages"] = torch.arange(4.0)
    batch.extras["old_logprobs"] = torch.zeros_like(batch.response_mask)
    sub = trim_padding(batch.select(slice(2, 4)))
    width = int(batch.attention_mask[2:4].sum(1).max())
    assert sub.input_ids.shape == (2, width) and sub.extras["old_logprobs"].shape == (2, width)
    assert torch.equal(sub.extras["advantages"], torch.tensor([2.0, 3.0]))
    assert torch.equal(sub.input_ids, batch.input_ids[2:4, :width])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"role": "judge"}, "role='judge'"),
        ({"dtype": "float8"}, "dtype='float8'"),
        ({"temperature": 0.0}, "temperature=0.0"),
    ],
)
def test_bad_options_raise_clear_errors(tiny_model_dir, kwargs, match):
    with pytest.raises(EngineConfigError, match=match):
        TorchTrainEngine(tiny_model_dir, **kwargs)


def test_bad_calls_raise_clear_errors(tiny_model_dir, tmp_path):
    engine = make_trainer(tiny_model_dir)
    batch = random_batch(2)
    with pytest.raises(EngineConfigError, match="role='critic'"):
        engine.forward(batch, values=True)
    with pytest.raises(EngineConfigError, match="micro_batch_size=0"):
        engine.train_step(batch, sft_loss, micro_batch_size=0)
    with pytest.raises(EngineConfigError, match="scalar tensor"):
        engine.train_step(batch, lambda out, micro, den: out["logprobs"], micro_batch_size=2)
    with pytest.raises(EngineError, match="no train-engine checkpoint"):
        engine.load(str(tmp_path / "missing"))
    with pytest.raises(EngineConfigError, match="not a directory"):
        TorchTrainEngine(str(tmp_path / "nope"))


def test_the_loss_gets_each_micro_batch_on_the_engine_device(tiny_model_dir, monkeypatch):
    """On a GPU the outputs are on it and the batch arrives on the CPU: the engine moves each micro-batch
    before the loss mixes the two (an H200 run failed "Expected all tensors to be on the same device")."""
    from flowrl.engines.types import TokenBatch

    moved, real = [], TokenBatch.to
    monkeypatch.setattr(TokenBatch, "to", lambda self, device: moved.append(torch.device(device)) or real(self, device))
    engine = make_trainer(tiny_model_dir)
    seen = []

    def loss(outputs, micro, denominator):
        seen.append({t.device for t in (outputs["logprobs"], micro.response_mask, *micro.extras.values())})
        return sft_loss(outputs, micro, denominator)

    engine.train_step(random_batch(rows=6), loss, micro_batch_size=2)
    assert len(moved) == len(seen) == 3 and {d.type for d in moved} == {engine.device.type}
    assert all({d.type for d in devices} == {engine.device.type} for devices in seen)


def test_token_batch_moves_every_tensor_and_is_itself_where_they_are():
    from flowrl.engines.types import TokenBatch

    batch = TokenBatch.from_rows([[1, 2, 3], [4, 5]], pad_id=0)
    batch.extras["advantages"] = torch.ones(2)
    assert batch.to("cpu") is batch
    meta = batch.to("meta")
    tensors = (meta.input_ids, meta.attention_mask, meta.response_mask, *meta.extras.values())
    assert {t.device.type for t in tensors} == {"meta"} and list(meta.extras) == ["advantages"]
    assert meta.input_ids.shape == batch.input_ids.shape and meta.input_ids.dtype == torch.long


def test_without_a_device_the_torch_engines_take_the_gpu_their_process_sees(tiny_model_dir, monkeypatch):
    """The runtime builds engines without a device: on a GPU node the torch trainer and ``hf_generate``
    must run on the GPU Ray gave them (an H200 run trained a 0.5B model on the CPU at 37 s a step)."""
    from flowrl.engines.base import accelerator
    from flowrl.engines.torch_rollout import TorchRolloutEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert accelerator() == "cpu" and TorchTrainEngine(tiny_model_dir).device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert accelerator() == "cuda"
    for build in (TorchTrainEngine, TorchRolloutEngine):
        try:
            engine = build(tiny_model_dir)
        except (AssertionError, RuntimeError) as error:  # a CPU build of torch: reaching for CUDA fails
            assert "CUDA" in str(error)
        else:  # a GPU machine
            assert engine.device.type == "cuda"
    assert TorchTrainEngine(tiny_model_dir, device="cpu").device == torch.device("cpu")


def test_weights_adopted_into_a_sync_home_train_bit_identically_and_are_sent_in_place(tiny_model_dir, tmp_path):
    """A broadcast sender homes the trainer's weights (``BroadcastSync.home``); the engine adopts them: training
    is bit-identical to an engine that did not, the parameters stay in the home (the optimizer writes there), a
    checkpoint round-trips, and the next send copies nothing."""
    from flowrl.runtime.sync import BroadcastSync
    from flowrl.runtime.sync.endpoint import home_weights
    from flowrl.runtime.weight_sync import BucketPacker, SyncStats, plan_buckets
    from flowrl.runtime.sync.broadcast import trailer_bytes

    optim = OptimConfig(lr=1e-2, weight_decay=0.01)
    plain, homed = make_trainer(tiny_model_dir, optim=optim), make_trainer(tiny_model_dir, optim=optim)
    sync = BroadcastSync("sender", world_size=2, bucket_bytes=64 << 10, timeout_s=5)
    try:
        moved = home_weights(sync, homed)
        home = sync._packer.home
        params = dict(homed.model.named_parameters())
        assert moved == len(params) + len(dict(homed.model.named_buffers(remove_duplicate=True)).keys()
                                           & set(home.views))
        start, end = home.buffer.data_ptr(), home.buffer.data_ptr() + home.buffer.nbytes
        assert all(start <= p.data_ptr() < end for p in params.values())

        assert train_a_few_steps(plain, steps=3) == train_a_few_steps(homed, steps=3)
        assert all(start <= p.data_ptr() < end for p in homed.model.parameters())
        weights = _params(plain)
        assert all(torch.equal(t, weights[n]) for n, t in homed.named_weights())

        homed.save(str(tmp_path / "ckpt"))
        train_a_few_steps(homed, steps=1)
        homed.load(str(tmp_path / "ckpt"))  # loads in place: the weights stay home
        assert all(torch.equal(t, weights[n]) for n, t in homed.named_weights())
        assert all(start <= p.data_ptr() < end for p in homed.model.parameters())

        packer, stats = BucketPacker(sync.bucket_bytes), SyncStats()
        packer.home = home
        for planned in plan_buckets(homed.named_weights(), sync.bucket_bytes):
            packer.release(packer.fill(planned, stats, trailer_bytes(len(planned.tensors))))
        assert stats.copied_bytes == 0 and stats.bytes > 0
    finally:
        sync.close()


def test_weights_that_cannot_move_are_left_and_the_home_is_dropped(tiny_model_dir):
    from flowrl.runtime.sync import BroadcastSync
    from flowrl.runtime.sync.endpoint import home_weights

    lora = make_trainer(tiny_model_dir, lora={"r": 2, "alpha": 4, "dropout": 0.0, "targets": ["q_proj"]})
    sync = BroadcastSync("sender", world_size=2, bucket_bytes=1 << 20, timeout_s=5)
    try:
        before = {n: p.data_ptr() for n, p in lora.model.named_parameters()}
        assert home_weights(sync, lora) == 0 and sync._packer.home is None
        assert {n: p.data_ptr() for n, p in lora.model.named_parameters()} == before
        # An engine that cannot adopt them is never asked for its weights (a sharded one would gather them).
        calls = []
        assert lora.adopt_weights(lambda weights: calls.append(weights) or {}) == 0 and not calls

        # Weights off the CPU are not homed (a GPU trainer's buckets go through host memory anyway).
        plain = make_trainer(tiny_model_dir)
        on_meta = lambda weights: sync.home([(n, t.to("meta")) for n, t in weights])  # noqa: E731
        assert plain.adopt_weights(on_meta) == 0 and sync._packer.home is None
    finally:
        sync.close()
