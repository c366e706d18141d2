"""``cuda_ipc``: shared device buffers, checksummed where the bytes are.

On CPU the same class shares host buffers by shared-memory file handles, so the packing, the
checksums, the handles crossing into another process and the fault paths run here; the CUDA
path (``cudaIpcMemHandle`` through ``rebuild_cuda_tensor``) is marked ``gpu``."""

import pickle

import pytest
import torch

from flowrl.runtime.sync import PROTOCOLS, CudaIpcSync, IpcHandoff, WeightSyncError
from flowrl.runtime.sync import cuda_ipc
from flowrl.runtime.sync.cuda_ipc import word_checksum
from flowrl.runtime.sync.endpoint import open_end, receive_weights, send_weights
from flowrl.runtime.weight_sync import CorruptedWeights, LostWeights
from sync_testkit import collect, digest, ipc_receiver, model_weights, start_children


def test_the_catalogue_names_the_class():
    assert PROTOCOLS["cuda_ipc"] is CudaIpcSync and not CudaIpcSync.collective


def test_word_checksum_sees_a_flipped_bit_and_swapped_words_and_ignores_chunking(monkeypatch):
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    base = word_checksum(data)
    flipped = data.clone()
    flipped[1234] ^= 0x01
    assert word_checksum(flipped)[0] != base[0]
    swapped = data.clone().view(torch.int32)
    swapped[[3, 7]] = swapped[[7, 3]]
    s = word_checksum(swapped.view(torch.uint8))
    assert s[0] == base[0] and s[1] != base[1]  # a plain sum misses a swap; the weighted one does not
    monkeypatch.setattr(cuda_ipc, "CHUNK_WORDS", 100)  # 11 chunks: int64 wrap-around sums are order-free
    assert word_checksum(data) == base


def test_handles_cross_into_another_process_bit_exact():
    """The sender's buffers, shared by handle, read in a spawned process: every dtype, a
    non-contiguous tensor, a 0-d one, several buffers."""
    sender = CudaIpcSync("sender", bucket_bytes=700, device="cpu")
    stats = sender.send(model_weights(3), 3)
    handoff = pickle.loads(pickle.dumps(sender.handoff()))  # what Ray does to it
    assert isinstance(handoff, IpcHandoff) and handoff.count == stats.buckets > 1
    procs, q = start_children(ipc_receiver, [(handoff,)])
    (got, devices, nbytes), = collect(procs, q)
    assert got == digest(model_weights(3)) and devices == {"cpu"} and nbytes == stats.bytes
    sender.close()


def test_damage_after_packing_names_the_tensor_and_a_lost_buffer_is_found():
    sender, _ = open_end("cuda_ipc", "sender", {"bucket_bytes": 700, "device": "cpu"})
    receiver, _ = open_end("cuda_ipc", "receiver", {})
    _stats, handoff = send_weights(sender, model_weights(1), 1, corrupt=True)
    first = handoff.buckets[0].tensors[0].name
    with pytest.raises(CorruptedWeights, match=rf"tensor {first!r} \(buffer 0\) arrived with checksum"):
        receive_weights(receiver, handoff)
    _stats, handoff = send_weights(sender, model_weights(2), 2, lose=True)
    with pytest.raises(LostWeights, match=r"buffer\(s\) \d+ of the \d+ shared for version 2 never arrived"):
        receive_weights(receiver, handoff)
    _stats, handoff = send_weights(sender, model_weights(2), 2)
    pairs, rstats = receive_weights(receiver, handoff)
    assert digest(pairs) == digest(model_weights(2)) and rstats["version"] == 2


def test_roles_and_handoffs_are_checked():
    sender, receiver = CudaIpcSync("sender", device="cpu"), CudaIpcSync("receiver")
    with pytest.raises(WeightSyncError, match=r"handoff\(\) before send\(\)"):
        sender.handoff()
    with pytest.raises(WeightSyncError, match="expected the sender's IpcHandoff"):
        list(receiver.receive(None))
    with pytest.raises(WeightSyncError, match="a receiver cannot send"):
        receiver.send(model_weights(1), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs an NVIDIA GPU")
def test_cuda_handles_cross_into_another_process_on_the_same_gpu():
    sender = CudaIpcSync("sender", bucket_bytes=700)
    weights = [(n, t.cuda()) for n, t in model_weights(5)]
    stats = sender.send(weights, 5)
    handoff = sender.handoff()
    assert handoff.buckets[0].handle[0] == "cuda"
    procs, q = start_children(ipc_receiver, [(handoff, "cuda")])
    (got, devices, nbytes), = collect(procs, q)
    assert got == digest(model_weights(5)) and devices == {"cuda"} and nbytes == stats.bytes
    sender.close()


def test_release_frees_the_buffers_and_the_next_send_packs_anew():
    sender, receiver = CudaIpcSync("sender", bucket_bytes=700, device="cpu"), CudaIpcSync("receiver")
    sender.send(model_weights(1), 1)
    handoff = sender.handoff()
    assert digest(receiver.receive(handoff)) == digest(model_weights(1))
    sender.release()
    assert sender._held == []
    sender.send(model_weights(2), 2)
    assert digest(receiver.receive(sender.handoff())) == digest(model_weights(2))
