"""Every protocol driven the way the driver drives it: trainer and rollout workers as Ray actors.

Non-collective protocols: the trainer sends, the driver ``ray.put``s the handoff once
and every replica receives it. Collective ones: send and receive run concurrently.
"""

import pytest

ray = pytest.importorskip("ray")

import sync_testkit  # noqa: E402
from flowrl.runtime.sync import WeightSyncError, is_collective  # noqa: E402
from sync_testkit import SyncHost, digest, model_weights  # noqa: E402

REPLICAS = 2


@pytest.fixture(scope="module")
def hosts():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    ray.cloudpickle.register_pickle_by_value(sync_testkit)  # workers need not find tests/ on their path
    actor = ray.remote(num_cpus=0)(SyncHost)
    trainer, rollouts = actor.remote(), [actor.remote() for _ in range(REPLICAS)]
    yield trainer, rollouts
    for a in [trainer, *rollouts]:
        ray.kill(a)
    if started:
        ray.shutdown()


def push(trainer, rollouts, key: str, name: str, version: int, options: dict, tamper=None) -> list[dict]:
    """One resync as the driver does it; returns each replica's receive stats."""
    if is_collective(name, **options):
        return ray.get([trainer.send.remote(key, version)] + [r.receive.remote(key, None) for r in rollouts])[1:]
    handoff, _ = ray.get(trainer.send.remote(key, version))
    ref = ray.put(tamper(handoff) if tamper else handoff)
    return ray.get([r.receive.remote(key, ref) for r in rollouts])


def open_pair(trainer, rollouts, key, name, options, receiver_options=None):
    rdzv = ray.get(trainer.open.remote(key, name, "sender", {**options, **({"world_size": 1 + REPLICAS}
                                                                           if is_collective(name, **options) else {})}))
    per_rank = [dict(receiver_options or {}) for _ in rollouts]
    if rdzv is not None:
        for rank, o in enumerate(per_rank, start=1):
            o.update(rendezvous=rdzv, rank=rank)
    ray.get([r.open.remote(key, name, "receiver", o) for r, o in zip(rollouts, per_rank)])


@pytest.mark.parametrize("name, options", [
    ("inplace", {"bucket_bytes": 700}),
    ("broadcast", {"bucket_bytes": 700, "timeout_s": 60}),
    ("checkpoint", {"bucket_bytes": 700}),
    ("delta", {"inner": "inplace", "bucket_bytes": 700}),
], ids=["inplace", "broadcast", "checkpoint", "delta"])
def test_each_protocol_delivers_verified_weights_to_every_replica(hosts, tmp_path, name, options):
    trainer, rollouts = hosts
    if name == "checkpoint":
        options = {**options, "directory": str(tmp_path)}
    receiver_options = {k: v for k, v in options.items() if k not in ("bucket_bytes",)}
    open_pair(trainer, rollouts, name, name, options, receiver_options)
    for version in (1, 2):
        stats = push(trainer, rollouts, name, name, version, options)
        assert all(s["version"] == version for s in stats)
        assert ray.get([r.digest.remote() for r in rollouts]) == [digest(model_weights(version))] * REPLICAS
    if name == "delta":
        assert [s["skipped"] for s in stats] == [5] * REPLICAS  # v2 sent only the tensors that changed
    ray.get([h.close.remote(name) for h in [trainer, *rollouts]])


def test_corruption_in_the_driver_is_named_by_the_replica(hosts):
    trainer, rollouts = hosts
    open_pair(trainer, rollouts, "faulty", "inplace", {"bucket_bytes": 700})

    def flip(handoff):  # the driver's Faults.corrupt_bucket_at_step does this to bucket 0
        bucket = handoff.buckets[0]
        data = bucket.data.copy()
        data[len(data) // 2] ^= 0xFF
        return handoff._replace(buckets=[bucket._replace(data=data), *handoff.buckets[1:]])

    with pytest.raises(WeightSyncError, match=r"tensor '.*' in bucket 0 is corrupted: crc32"):
        push(trainer, rollouts, "faulty", "inplace", 1, {}, tamper=flip)
