"""Read back what each experiment tracker wrote, with that library's own reader.

* TensorBoard: ``EventAccumulator`` (tensorboard's own event-file reader), in a fresh process.
* Weights & Biases: wandb 0.31 has no Python reader for offline runs (``wandb.Api`` is
  online-only and the old ``wandb.sdk.internal.datastore`` is gone); the ``.wandb`` file is
  a LevelDB-style log of ``wandb.proto.wandb_internal_pb2.Record`` protobufs, so it is read
  here with wandb's own protobuf classes and the log framing spelled out below.
* MLflow: ``MlflowClient`` on the file store.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

# The .wandb file: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of
# records, each framed by crc32c (4 bytes), length (2, little-endian) and type (1): FULL, or a
# record split over blocks as FIRST, MIDDLE..., LAST.
_HEADER = 7
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every ``Record`` protobuf of an offline run's ``run-*.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    records, pos, pending = [], _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        if kind in (_FULL, _FIRST):
            pending = payload
        else:
            pending += payload
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: Path, part: int = -1) -> list[dict]:
    """The history rows (one per step) of an offline run under ``run_dir``: the latest, or the
    ``part``-th in time order (a resumed run writes one offline run per process)."""
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))  # named offline-run-<time>-<id>
    assert files, f"no offline W&B run under {run_dir}"
    rows = []
    for record in wandb_records(files[part]):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in record.history.item:
            *parents, leaf = [item.key] if item.key else list(item.nested_key)
            node = row
            for name in parents:  # a logged object (a wandb.Table) comes as one item per field
                node = node.setdefault(name, {})
            node[leaf] = json.loads(item.value_json)
        rows.append(row)
    return rows


_TB_READ = """
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
texts = {t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)] for t in acc.Tags()["tensors"] if t.endswith("/text_summary")}
print(json.dumps({"scalars": scalars, "texts": texts}))
"""


def _tensorboard(run_dir: Path) -> dict:
    """What ``EventAccumulator`` reads from ``run_dir/tensorboard``, read in a fresh process as the
    TensorBoard UI reads it (nothing of the writing process's state can help it)."""
    out = subprocess.run([sys.executable, "-c", _TB_READ, str(run_dir / "tensorboard")], capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout)


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of every scalar TensorBoard reads from ``run_dir/tensorboard``."""
    return {tag: [tuple(e) for e in events] for tag, events in _tensorboard(run_dir)["scalars"].items()}


def tensorboard_texts(run_dir: Path, tag: str) -> list[tuple[int, str]]:
    """[(step, text)] of a text summary (``add_text``) as TensorBoard reads it."""
    return [tuple(e) for e in _tensorboard(run_dir)["texts"].get(f"{tag}/text_summary", [])]


def mlflow_run(run_dir: Path):
    """``(client, run)`` of the one MLflow run in ``run_dir/mlruns`` (experiment ``flowrl``)."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = (run_dir / "mlruns").resolve().as_uri()
    mlflow.set_tracking_uri(uri)  # MlflowClient.load_table searches runs through the global URI
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("flowrl")
    assert exp is not None, f"no MLflow experiment `flowrl` in {run_dir / 'mlruns'}"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, f"expected one MLflow run, found {len(runs)}"
    return client, runs[0]
