"""State files (:mod:`flowrl.runtime.statefile`): what a checkpoint's in-flight steps and partial
rollouts are written as. They read back equal, type for type; anything else is refused when it is
written (never pickled); a file replaced by a pickle runs nothing when read."""

from __future__ import annotations

import datetime
import decimal
import math
import os
import pickle
import uuid

import numpy as np
import pytest
import torch

from flowrl.engines.types import Completion, TokenBatch
from flowrl.runtime.statefile import StateFileError, read_state, refuse_unsafe_files, tensor_file, write_state
from flowrl.runtime.step import Rollouts, StepValue


class Payload:
    """Unpickling it writes ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def same(a, b) -> bool:
    """Equal, with the same types all the way down (a tuple is not a list, np.float32 not float)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad and \
            torch.equal(a.detach(), b.detach())
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (StepValue, Rollouts, TokenBatch, Completion)):
        return all(same(getattr(a, f), getattr(b, f)) for f in vars(a))
    return a == b


def step_value() -> StepValue:
    comps = [Completion((1, 2), (3, 4), (-0.5, -0.25), "stop", "x", routed_experts=np.full((4, 2, 1), -1, np.int16)),
             Completion((1,), (), (), "length", "")]
    batch = TokenBatch(torch.tensor([[1, 2, 3], [1, 0, 0]]), torch.ones(2, 3, dtype=torch.int64),
                       torch.tensor([[0., 1., 1.], [0., 0., 0.]]),
                       {"rollout_logprobs": torch.randn(2, 3, dtype=torch.bfloat16)})
    shared = torch.arange(10)
    return StepValue({"prompt_ids": [[1, 2], [1]], "response_mask": batch.response_mask, "version": [3, 3],
                      "rows": [{"prompt": "2+5", "answer": "7", "meta": {"n": None, "ok": True}}] * 2,
                      "view_a": shared[:4], "view_b": shared[2:8:2], "done": torch.tensor([True, False]),
                      "completions": comps, "empty": torch.zeros(0, 3)},
                     Rollouts("policy", batch, ("x", "")))


def test_values_read_back_equal_type_for_type(tmp_path):
    value = [(2, {"gen": step_value(), "scores": StepValue({"rewards": [1.0, float("nan"), -float("inf")]})},
              {"reward/mean": 0.5, "n": 3}),
             {"ids": (1, (2, 3)), 7: "int key", (1, 2): [b"\x00\xff"], "f32": np.float32(0.1), "i64": np.int64(-3),
              "b": np.bool_(True), "big": 2 ** 80, "arr": np.arange(6, dtype=np.uint8).reshape(2, 3),
              "p": torch.nn.Parameter(torch.ones(2)), "s": "é\u2028", "nested": [[], {}, ()],
              "parquet": [datetime.datetime(2026, 12, 7, 21, 30, 1, 5, tzinfo=datetime.timezone.utc),
                          datetime.date(2026, 1, 2), datetime.time(3, 4, 5, 6), datetime.timedelta(days=-1, microseconds=7),
                          decimal.Decimal("1.10"), uuid.UUID(int=5)]}]
    files = write_state(tmp_path / "state.json", value)
    assert [p.name for p in files] == ["state.json", "state.safetensors"]
    assert same(read_state(tmp_path / "state.json"), [value[0], {**value[1], "p": torch.ones(2).requires_grad_()}])


def test_a_value_without_tensors_is_one_json_file(tmp_path):
    assert write_state(tmp_path / "s.json", {"a": [1, 2.5, None]}) == [tmp_path / "s.json"]
    assert read_state(tmp_path / "s.json") == {"a": [1, 2.5, None]}


@pytest.mark.parametrize("bad, where", [
    ({"ok": [1, {2}]}, r"value\['ok'\]\[1\] is a set"),
    ([StepValue({"x": object()})], r"value\[0\]\.fields\['x'\] is a object"),
    ({"f": lambda: 1}, r"value\['f'\] is a function"),
    ({"o": np.array(["a"], dtype=object)}, r"value\['o'\] is a numpy ndarray of object"),
    ({"t": torch.zeros(2).to_sparse()}, r"value\['t'\] is a Tensor \(layout torch.sparse_coo\)"),
    ({"e": Payload("/nonexistent")}, r"value\['e'\] is a Payload"),
])
def test_anything_else_is_refused_when_written_naming_where_it_is(tmp_path, bad, where):
    with pytest.raises(StateFileError, match=where + r", which .*never a pickle"):
        write_state(tmp_path / "s.json", bad)


def test_a_pickle_put_in_its_place_runs_nothing_and_is_named(tmp_path):
    write_state(tmp_path / "s.json", {"t": torch.ones(2)})
    marker = tmp_path / "pwned"
    for target in (tmp_path / "s.json", tensor_file(tmp_path / "s.json")):
        saved = target.read_bytes()
        target.write_bytes(pickle.dumps(Payload(marker)))
        with pytest.raises(StateFileError, match=f"{target.name} is not a state file this flowrl wrote"):
            read_state(tmp_path / "s.json")
        target.write_bytes(saved)
    assert not marker.exists()
    assert same(read_state(tmp_path / "s.json"), {"t": torch.ones(2)})


@pytest.mark.parametrize("text", ['{"format": "flowrl-state", "version": 1, "value": {"$": "Payload", "v": {}}}',
                                  '{"format": "flowrl-state", "version": 1, "value": {"$": "tensor", "k": "0"}}',
                                  '{"format": "flowrl-state", "version": 2, "value": 1}', '[1]', ''])
def test_a_forged_state_file_is_refused(tmp_path, text):
    (tmp_path / "s.json").write_text(text)
    with pytest.raises(StateFileError, match="hint: it was damaged or replaced"):
        read_state(tmp_path / "s.json")


def test_an_older_flowrl_s_pickles_are_refused_unread(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / "policy").mkdir(parents=True)
    (tmp_path / "ckpt" / "partial.pkl").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(StateFileError, match=r"holds partial.pkl: a pickle, written by an older flowrl; .*start a new run"):
        refuse_unsafe_files(tmp_path / "ckpt")
    assert not marker.exists() and os.listdir(tmp_path / "ckpt" / "policy") == []


def test_an_engine_state_replaced_by_a_torch_saved_payload_runs_nothing(tmp_path):
    """Engine checkpoints (``engine_state.pt``, Megatron's and FSDP's per-rank files) are read with
    ``weights_only=True``: torch's own container with code in its pickle is refused, naming the file."""
    from flowrl.engines.base import EngineError, load_tensors_file

    marker, file = tmp_path / "pwned", tmp_path / "engine_state.pt"
    torch.save(Payload(marker), file)
    with pytest.raises(EngineError, match=r"engine_state.pt is not an engine checkpoint this flowrl wrote "
                                          r"\(UnpicklingError: Weights only load failed\); it was not loaded"):
        load_tensors_file(file)
    file.write_bytes(pickle.dumps(Payload(marker), protocol=2))
    with pytest.raises(EngineError, match="it was not loaded"):
        load_tensors_file(file)
    assert not marker.exists()
    torch.save({"step": 3, "rng": torch.get_rng_state()}, file)
    assert load_tensors_file(file)["step"] == 3


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp_s_checkpoint_metadata_is_read_with_an_allowlist(tmp_path):
    """torch.distributed.checkpoint reads its ``.metadata`` with pickle.load: the FSDP engine reads it with
    an allowlist of DCP's own records instead; a pickle with code in it is refused, a real one reads."""
    import torch.distributed.checkpoint as dcp

    from flowrl.engines.fsdp_rank import _safe_metadata

    dcp.save({"w": torch.ones(2, 3), "step": 3, "groups": [{"lr": 0.1}]}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with open(tmp_path / "dcp" / ".metadata", "rb") as f:
        assert sorted(_safe_metadata(f).state_dict_metadata) == ["groups.0.lr", "step", "w"]
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with open(tmp_path / "dcp" / ".metadata", "rb") as f, pytest.raises(pickle.UnpicklingError, match=r"io.open is not allowed in a checkpoint.s metadata"):
        _safe_metadata(f)
    assert not marker.exists()
