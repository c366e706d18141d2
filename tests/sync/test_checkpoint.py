"""``checkpoint``: safetensors + manifest in a shared directory, published atomically, read by other processes."""

import json
import multiprocessing
import os
import signal

import pytest
import torch

from flowrl.runtime.sync import CheckpointHandoff, CheckpointSync, WeightSyncError
from sync_testkit import checkpoint_receiver, checkpoint_sender_stuck_in_v2, collect, digest, model_weights, \
    start_children


def test_another_process_reads_each_version_verified(tmp_path):
    sender = CheckpointSync("sender", directory=tmp_path, bucket_bytes=1024, keep=2)
    stats1 = sender.send(model_weights(1), 1)
    h1 = sender.handoff()
    sender.send(model_weights(2), 2)
    procs, q = start_children(checkpoint_receiver, [(str(tmp_path), [h1, None])])
    (outcomes,) = collect(procs, q)
    assert outcomes == [("ok", 1, digest(model_weights(1))), ("ok", 2, digest(model_weights(2)))]
    assert stats1.buckets > 1 and stats1.tensors == len(model_weights(1))  # several files of <= 1 KiB
    assert (tmp_path / "LATEST").read_text().strip() == "v00000002"
    sender.send(model_weights(3), 3)  # keep=2: v1 is pruned, v2 and v3 stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "v00000002", "v00000003"]


def test_corrupted_file_names_the_tensor(tmp_path):
    sender = CheckpointSync("sender", directory=tmp_path)
    sender.send(model_weights(1), 1)
    manifest = json.loads((tmp_path / "v00000001" / "manifest.json").read_text())
    entry = next(e for e in manifest["tensors"] if e["name"] == "layers.0.mlp.weight")
    path = tmp_path / "v00000001" / entry["file"]
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8:8 + header_len])[entry["name"]]["data_offsets"]
    data[8 + header_len + offsets[0] + 5] ^= 0x01  # one bit inside that tensor's data
    path.write_bytes(bytes(data))
    receiver = CheckpointSync("receiver", directory=tmp_path)
    with pytest.raises(WeightSyncError, match=r"tensor 'layers.0.mlp.weight' in .* is corrupted: crc32"):
        list(receiver.receive())
    path.write_bytes(b"\x00" * 7)  # a truncated file: unreadable, named
    with pytest.raises(WeightSyncError, match=r"weights-00000.safetensors is unreadable"):
        list(receiver.receive())


def test_killed_sender_never_exposes_a_half_written_version(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    stuck = ctx.Event()
    child = ctx.Process(target=checkpoint_sender_stuck_in_v2, args=(str(tmp_path), stuck))
    child.start()
    assert stuck.wait(timeout=120), "the sender never reached the middle of v2"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    leftovers = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and any(leftovers[0].iterdir())  # v2 was half on disk when killed
    receiver = CheckpointSync("receiver", directory=tmp_path)
    assert digest(receiver.receive()) == digest(model_weights(1))  # LATEST still names the complete v1
    assert receiver.version == 1
    sender = CheckpointSync("sender", directory=tmp_path)  # a new sender removes the leftovers
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())
    sender.send(model_weights(2), 2)
    assert digest(receiver.receive()) == digest(model_weights(2))


def test_tied_weights_and_version_checks(tmp_path):
    shared = torch.randn(8, 4)
    sender = CheckpointSync("sender", directory=tmp_path)
    sender.send([("embed.weight", shared), ("lm_head.weight", shared)], 5)  # same storage twice
    receiver = CheckpointSync("receiver", directory=tmp_path)
    got = dict(receiver.receive(sender.handoff()))
    assert torch.equal(got["embed.weight"], shared) and torch.equal(got["lm_head.weight"], shared)
    with pytest.raises(WeightSyncError, match="holds version 5, the sender wrote 6"):
        receiver.receive(CheckpointHandoff(6, str(tmp_path / "v00000005")))
    with pytest.raises(WeightSyncError, match="no LATEST"):
        CheckpointSync("receiver", directory=tmp_path / "elsewhere").receive()
    with pytest.raises(WeightSyncError, match="appears twice"):
        sender.send([("a", shared), ("a", shared)], 7)
    assert (tmp_path / "LATEST").read_text().strip() == "v00000005"  # the failed send published nothing
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())  # and left nothing behind
    with pytest.raises(WeightSyncError, match="keep=0"):
        CheckpointSync("sender", directory=tmp_path, keep=0)
