"""The protocol table, built from the catalogue's records: every schedule protocol name dispatches to the
class its record names; options and names are checked; a broadcast's backend is the record's transport."""

import pytest
import torch

from flowrl.catalog.protocols import PROTOCOLS as SCHEDULE_PROTOCOLS
from flowrl.runtime.sync import PROTOCOLS, BroadcastSync, WeightSync, WeightSyncError, is_collective, make_sync, \
    options_from_schedule, protocol_class


def test_every_protocol_the_compiler_accepts_has_a_component():
    assert set(SCHEDULE_PROTOCOLS) == set(PROTOCOLS)
    for name, spec in SCHEDULE_PROTOCOLS.items():
        module, _, cls = spec.runtime.partition(":")
        assert (PROTOCOLS[name].__module__, PROTOCOLS[name].__name__) == (module, cls), name


def test_a_broadcast_gets_the_records_transport_on_this_platform():
    # `nccl` on a machine without CUDA is a gloo group (its record's cpu transport); given a backend, it keeps it.
    platform = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ("nccl", "gloo", "broadcast"):
        end = make_sync(name, "sender", world_size=2)
        assert end.backend == SCHEDULE_PROTOCOLS[name].transport[platform], name
        end.close()
    if not torch.cuda.is_available():
        with pytest.raises(WeightSyncError, match="backend='nccl' needs CUDA"):
            make_sync("gloo", "sender", world_size=2, backend="nccl")


@pytest.mark.parametrize("name, collective", [("inplace", False), ("ipc", False), ("broadcast", True),
                                              ("gloo", True), ("nccl", True), ("checkpoint", False),
                                              ("delta", False)])
def test_collective_flag(name, collective):
    assert is_collective(name) is collective


def test_delta_inherits_its_inner_protocols_flag():
    assert is_collective("delta", inner="broadcast") is True
    assert is_collective("delta", inner="checkpoint") is False


def test_every_end_implements_the_weight_sync_protocol(tmp_path):
    ends = [make_sync("inplace", "sender"), make_sync("checkpoint", "receiver", directory=tmp_path),
            make_sync("delta", "receiver"), make_sync("gloo", "sender", world_size=2)]
    for end in ends:
        assert isinstance(end, WeightSync)
        end.close()
    assert protocol_class("gloo") is BroadcastSync and ends[-1].backend == "gloo"


@pytest.mark.parametrize("name, role, options, message", [
    ("brodcast", "sender", {}, r"unknown weight-sync protocol 'brodcast'; hint: did you mean `broadcast`\?"),
    ("rsync", "sender", {}, r"unknown weight-sync protocol 'rsync'; hint: protocols: broadcast, checkpoint"),
    ("inplace", "sender", {"bucket": 1}, r"protocol `inplace` has no option 'bucket'; hint: its options are "
                                         r"bucket_bytes"),
    ("inplace", "trainer", {}, r"inplace: role='trainer'; hint: use one of \('sender', 'receiver'\)"),
    ("checkpoint", "sender", {"directory": "/tmp/x", "bucket_bytes": 0}, r"bucket_bytes=0"),
])
def test_bad_names_and_options_are_clear_errors(name, role, options, message):
    with pytest.raises(WeightSyncError, match=message):
        make_sync(name, role, **options)


def test_every_schedule_keyword_maps_to_a_component_argument(tmp_path):
    examples = {"bucket": 1 << 20, "overlap": False, "dir": str(tmp_path), "keep": 2, "threshold": 0.5}
    for name, spec in SCHEDULE_PROTOCOLS.items():
        options = options_from_schedule({key: examples[key] for key in spec.options})
        if is_collective(name):
            options["world_size"] = 2
        end = make_sync(name, "sender", **options)  # raises on an option the component lacks
        end.close()
    assert options_from_schedule({"bucket": 1024, "dir": ""}) == {"bucket_bytes": 1024}
    with pytest.raises(WeightSyncError, match="option 'compress' has no component argument"):
        options_from_schedule({"compress": True})
