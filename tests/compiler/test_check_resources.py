"""`flowrl check` checks what a flow names on disk, without running it: datasets, checkpoints,
user modules (check_resources), and whether each model fits its engines (check_model_fit).

Every case writes a flow file and its resources into a temporary folder and checks the file
as ``flowrl check`` does (``check_file``), usually from another current directory: relative
paths must resolve against the flow file's folder, never the current directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.compiler.pipeline import check_file, compile_file, compile_text
from flowrl.diagnostics import FlowError
from model_dirs import EMPTY_SAFETENSORS, write_char_tokenizer, write_empty_weights, write_planned_checkpoint

ROOT = Path(__file__).resolve().parents[2]

ROWS = [{"prompt": "12+30=", "answer": "42"}, {"prompt": "1+1=", "answer": "2"}]

GRPO_BODY = """
flow main() {
  x = generate(policy, sample(d, size = 2), n = 2, max_tokens = MAX)
  update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x))
}
"""


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def flow(tmp: Path, head: str, *, max_tokens: int = 8, schedule: str = "", name: str = "f.flow") -> Path:
    """A GRPO-style flow over ``policy``, dataset ``d`` and reward ``r`` declared in ``head``."""
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head.strip() + "\n" + GRPO_BODY.replace("MAX", str(max_tokens)) + schedule)
    return path


def codes_of(path: Path, cwd: Path | None = None) -> list:
    """The diagnostics of ``check_file(path)`` run from ``cwd`` (default: the filesystem root)."""
    old = os.getcwd()
    os.chdir(cwd or "/")
    try:
        check_file(str(path))
    except FlowError as e:
        return e.diagnostics
    finally:
        os.chdir(old)
    return []


def only(diags: list, code: str):
    assert [d.code for d in diags] == [code], [f"{d.code}: {d.message}" for d in diags]
    return diags[0]


@pytest.fixture
def tmp(tmp_path) -> Path:
    write_jsonl(tmp_path / "data" / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "data" / "test.jsonl", ROWS[:1])
    return tmp_path


TINY = 'model policy = tiny()\nreward r = verifier("exact")\n'


# ---- datasets -----------------------------------------------------------------------------------


def test_datasets_resolve_against_the_flow_files_folder_not_the_current_directory(tmp):
    path = flow(tmp, TINY + 'dataset d = jsonl("data/train.jsonl", eval = "data/test.jsonl")')
    assert codes_of(path, cwd=Path("/")) == []
    nested = flow(tmp / "flows", TINY + 'dataset d = jsonl("../data/train.jsonl")')
    assert codes_of(nested, cwd=tmp / "data") == []


def test_missing_dataset_and_eval_split_name_the_folder_and_a_close_file(tmp):
    path = flow(tmp, TINY + 'dataset d = jsonl("data/train.jsonl", eval = "data/tset.jsonl")')
    d = only(codes_of(path), "E601")
    assert d.message == f"eval split not found: {tmp}/data/tset.jsonl"
    assert (d.span.line, d.span.column) == (3, 46)  # the eval path as written
    assert f"resolved against the folder of the flow file, {tmp}" in d.hint
    assert "did you mean `data/test.jsonl`" in d.hint
    path = flow(tmp, TINY + 'dataset d = jsonl("train.jsonl")')
    assert only(codes_of(path), "E601").message == f"dataset file not found: {tmp}/train.jsonl"


CODE_ROWS = [{"prompt": "add", "answer": "", "tests": ["assert add(1, 2) == 3"]},
             {"prompt": "f", "answer": "", "tests": {"fn_name": "f", "inputs": [[1]], "outputs": [2]}}]


def test_a_reward_reading_a_row_field_the_dataset_lacks_is_refused(tmp):
    """verifier("code") over rows without `tests` scores every sample as an error: check refuses it
    (E622) at the reward, naming the dataset, its file and the field."""
    head = 'model policy = tiny()\nreward r = verifier("code")\ndataset d = jsonl("data/train.jsonl")'
    d = only(codes_of(flow(tmp, head)), "E622")
    assert (d.span.line, d.span.column) == (2, 12)
    assert d.message == ('`verifier("code")` reads each row\'s `tests` field, but dataset `d` (file `data/train.jsonl`) '
                         "lacks it: 2 of its first 2 rows have no `tests` field (the first: row 1); every sample would "
                         "score as an error")
    assert "add `tests` to every row" in d.hint
    write_jsonl(tmp / "data" / "code.jsonl", CODE_ROWS)
    ok = flow(tmp, head.replace("train.jsonl", "code.jsonl"))
    assert codes_of(ok) == []
    write_jsonl(tmp / "data" / "mixed.jsonl", [*CODE_ROWS, ROWS[0]])  # a later row lacks it
    mixed = only(codes_of(flow(tmp, head.replace("train.jsonl", "mixed.jsonl"))), "E622")
    assert "1 of its first 3 rows have no `tests` field (the first: row 3)" in mixed.message
    # The eval split is scored by the same reward, unless the dataset names its own.
    both = head.replace('"data/train.jsonl"', '"data/code.jsonl", eval = "data/test.jsonl"')
    assert "(eval split `data/test.jsonl`)" in only(codes_of(flow(tmp, both)), "E622").message
    assert codes_of(flow(tmp, both.replace('"data/test.jsonl"', '"data/test.jsonl", eval_reward = "exact"'))) == []
    # A combined reward reads what its parts read; a named eval verifier too.
    combined = ('model policy = tiny()\nreward c = verifier("code")\nreward e = verifier("exact")\n'
                'reward r = weighted_sum(c, e, weights = [1.0, 1.0])\ndataset d = jsonl("data/train.jsonl")')
    assert "`verifier(\"code\")` reads each row's `tests`" in only(codes_of(flow(tmp, combined)), "E622").message
    named = TINY + 'dataset d = jsonl("data/train.jsonl", eval = "data/test.jsonl", eval_reward = "code")'
    e = only(codes_of(flow(tmp, named)), "E622")
    assert e.message.startswith('`eval_reward = "code"` reads each row\'s `tests` field, but dataset `d` (eval split')


def test_a_parquet_dataset_without_the_rewards_column_is_refused(tmp):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), tmp / "plain.parquet")
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"], "tests": ['["assert True"]']}), tmp / "code.parquet")
    head = 'model policy = tiny()\nreward r = verifier("code")\ndataset d = parquet("plain.parquet")'
    assert "it has no column `tests` (its columns: answer, prompt)" in only(codes_of(flow(tmp, head)), "E622").message
    assert codes_of(flow(tmp, head.replace("plain", "code"))) == []


def test_relative_flow_path_gives_relative_paths_in_messages(tmp):
    flow(tmp, TINY + 'dataset d = jsonl("data/nope.jsonl")', name="sub/f.flow")
    d = only(codes_of(Path("sub/f.flow"), cwd=tmp), "E601")
    assert d.message == "dataset file not found: sub/data/nope.jsonl"
    assert d.hint.endswith("resolved against the folder of the flow file, sub")


@pytest.mark.parametrize("rows,fragment", [
    (['{"prompt": "1+1="'], "line 1, cannot be read as `jsonl`: invalid JSON"),
    ([{"question": "1+1=", "answer": "2"}], "line 1, cannot be read as `jsonl`: missing field 'prompt'"),
    ([{"prompt": 5, "answer": "2"}], "field 'prompt' must be a string, got int"),
    (["", "[1, 2]"], "line 2, cannot be read as `jsonl`: expected a JSON object, got list"),
    ([], "dataset is empty"),
])
def test_first_row_is_read_as_the_runtime_reads_it(tmp, rows, fragment):
    write_jsonl(tmp / "bad.jsonl", rows)
    path = flow(tmp, TINY + 'dataset d = jsonl("bad.jsonl")')
    d = only(codes_of(path), "E602")
    assert fragment in d.message, d.message
    assert d.message.startswith("dataset file `bad.jsonl`")


def test_custom_field_names_and_only_the_first_row_is_read(tmp):
    # A broken second line is the runtime's to report: the check reads one row, not the file.
    write_jsonl(tmp / "q.jsonl", [{"question": "1+1=", "gold": "2"}, "not json"])
    path = flow(tmp, TINY + 'dataset d = jsonl("q.jsonl", prompt = "question", answer = "gold")')
    assert codes_of(path) == []
    path = flow(tmp, TINY + 'dataset d = jsonl("q.jsonl", prompt = "question")')
    assert "missing field 'answer'" in only(codes_of(path), "E602").message


def test_a_named_reference_completion_is_a_field_every_row_must_hold(tmp):
    write_jsonl(tmp / "q.jsonl", [{"prompt": "1+1=", "answer": "2", "solution": "1+1=2"}])
    assert codes_of(flow(tmp, TINY + 'dataset d = jsonl("q.jsonl", completion = "solution")')) == []
    path = flow(tmp, TINY + 'dataset d = jsonl("q.jsonl", completion = "worked")')
    assert "line 1, cannot be read as `jsonl`: missing field 'worked'" in only(codes_of(path), "E602").message


def test_not_utf8_is_refused(tmp):
    (tmp / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "x"}\n')
    path = flow(tmp, TINY + 'dataset d = jsonl("latin.jsonl")')
    assert "not UTF-8" in only(codes_of(path), "E602").message


def test_parquet_read_from_its_footer(tmp):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), tmp / "ok.parquet")
    pq.write_table(pa.table({"prompt": [1], "answer": ["2"]}), tmp / "int.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp / "empty.parquet")
    assert codes_of(flow(tmp, TINY + 'dataset d = parquet("ok.parquet")')) == []
    for name, fragment in [("int.parquet", "field 'prompt' must be a string, got a INT64 column"),
                           ("empty.parquet", "dataset is empty"),
                           ("data/train.jsonl", "not a readable Parquet file")]:
        path = flow(tmp, TINY + f'dataset d = parquet("{name}")')
        assert fragment in only(codes_of(path), "E602").message
    path = flow(tmp, TINY + 'dataset d = parquet("ok.parquet", answer = "gold")')
    assert "missing field 'gold'; the file has columns ['answer', 'prompt']" in only(codes_of(path), "E602").message


def test_jsonl_op_reads_json_lines_whatever_the_file_is_named(tmp):
    """The runtime reads a dataset by its op (its catalogue record's file_format), so does the check."""
    write_jsonl(tmp / "rows.txt", ROWS)
    assert codes_of(flow(tmp, TINY + 'dataset d = jsonl("rows.txt")')) == []


def test_unused_dataset_is_not_read(tmp):
    path = flow(tmp, TINY + 'dataset d = jsonl("data/train.jsonl")\ndataset unused = jsonl("nope.jsonl")')
    assert codes_of(path) == []


# ---- checkpoints ----------------------------------------------------------------------------------


def test_hf_needs_a_checkpoint_directory_or_a_known_model(tmp):
    head = 'reward r = verifier("exact")\ndataset d = jsonl("data/train.jsonl")\n'
    d = only(codes_of(flow(tmp, head + 'model policy = hf("ckpt")')), "E603")
    assert d.message == f'hf("ckpt"): {tmp}/ckpt is not a directory, and `ckpt` is not a model flowrl knows'
    assert f"resolved against the folder of the flow file, {tmp}" in d.hint
    (tmp / "ckpt").mkdir()
    assert "has no config.json" in only(codes_of(flow(tmp, head + 'model policy = hf("ckpt")')), "E603").message
    (tmp / "ckpt" / "config.json").write_text("{not json")
    assert "cannot read" in only(codes_of(flow(tmp, head + 'model policy = hf("ckpt")')), "E603").message
    assert codes_of(flow(tmp, head + 'model policy = hf("Qwen/Qwen2.5-0.5B")')) == []  # a preset
    d = only(codes_of(flow(tmp, head + 'model policy = hf("Qwen/Qwen2.5-0.5b-Instruct")')), "E603")
    assert "did you mean `Qwen/Qwen2.5-0.5B`" in d.hint


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 20,
         "max_position_embeddings": 128}


def _safetensors(tensors: dict[str, int], data_bytes: int) -> bytes:
    """A safetensors file whose tensors (name -> bytes, F32) end where their sizes add up, with ``data_bytes``
    of data after the header (fewer: a truncated file)."""
    import struct

    header, at = {}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [at, at + size]}
        at += size
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data_bytes)


def _ckpt_codes(tmp: Path, written: str = "ckpt") -> list:
    head = 'reward r = verifier("exact")\ndataset d = jsonl("data/train.jsonl")\n'
    return codes_of(flow(tmp, head + f'model policy = hf("{written}")'))


def test_a_model_directory_needs_weights_and_a_tokenizer(tmp):
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(LLAMA))
    d = _ckpt_codes(tmp)
    assert [x.code for x in d] == ["E620", "E620"]
    assert d[0].message == f'hf("ckpt") ({ckpt}): no weights: neither model.safetensors nor model.safetensors.index.json'
    assert "save_pretrained(dir)" in d[0].hint
    assert "no tokenizer" in d[1].message and "AutoTokenizer" in d[1].hint
    assert (d[0].span.line, d[0].span.column) == (3, 19)  # the hf(...) argument as written
    write_char_tokenizer(ckpt)
    write_empty_weights(ckpt)
    assert _ckpt_codes(tmp) == []
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "vocab.json").write_text("{}")
    assert "no tokenizer" in only(_ckpt_codes(tmp), "E620").message  # a BPE vocabulary needs its merges
    (ckpt / "merges.txt").write_text("")
    assert _ckpt_codes(tmp) == []


def test_pickled_weights_are_refused_with_the_conversion(tmp):
    ckpt = write_planned_checkpoint(tmp / "ckpt", LLAMA)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    d = only(_ckpt_codes(tmp), "E620")
    assert "pytorch_model.bin, a PyTorch pickle (loading one can run code)" in d.message
    assert f"from_pretrained('{ckpt}').save_pretrained('{ckpt}')" in d.hint
    assert "never reads a weight format that can execute code" in d.hint


@pytest.mark.parametrize("damage, words", [
    (lambda f: f.write_bytes(f.read_bytes()[:-10]), "is truncated: its tensors end at byte 64 of the data, which holds 54"),
    (lambda f: f.write_bytes(f.read_bytes()[:5]), "shorter than its header's length"),
    (lambda f: f.write_bytes(b"\xff" * 8 + b"{}"), "is not a safetensors file or is truncated"),
    (lambda f: f.write_bytes(EMPTY_SAFETENSORS[:8] + b"{not json"), "header is not JSON"),
])
def test_a_damaged_safetensors_file_is_caught_from_its_header(tmp, damage, words):
    ckpt = write_planned_checkpoint(tmp / "ckpt", LLAMA)
    f = ckpt / "model.safetensors"
    f.write_bytes(_safetensors({"a": 32, "b": 32}, 64))
    assert _ckpt_codes(tmp) == []
    damage(f)
    d = only(_ckpt_codes(tmp), "E620")
    assert words in d.message and "model.safetensors" in d.message


def test_every_shard_of_an_index_must_be_there_and_whole(tmp):
    ckpt = write_planned_checkpoint(tmp / "ckpt", LLAMA)
    (ckpt / "model.safetensors").unlink()
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    (ckpt / shards[0]).write_bytes(_safetensors({"a": 16}, 16))
    d = only(_ckpt_codes(tmp), "E620")
    assert f"names 2 shard(s), and {shards[1]} is missing" in d.message
    (ckpt / shards[1]).write_bytes(_safetensors({"b": 16}, 8))
    assert f"{shards[1]} is truncated" in only(_ckpt_codes(tmp), "E620").message
    (ckpt / shards[1]).write_bytes(_safetensors({"b": 16}, 16))
    assert _ckpt_codes(tmp) == []


def test_config_of_an_architecture_flowrl_does_not_know(tmp):
    write_planned_checkpoint(tmp / "ckpt", {**LLAMA, "architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    d = only(_ckpt_codes(tmp), "E603")
    assert "names FalconForCausalLM, an architecture flowrl does not know" in d.message
    assert "LlamaForCausalLM" in d.hint


def test_a_partial_hub_download_is_refused_at_check(tmp, monkeypatch):
    hub = tmp / "hub"
    snapshot = hub / "models--acme--partial" / "snapshots" / ("0" * 40)
    write_planned_checkpoint(snapshot, LLAMA)
    (hub / "models--acme--partial" / "refs").mkdir()
    (hub / "models--acme--partial" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert _ckpt_codes(tmp, "acme/partial") == []
    (snapshot / "model.safetensors").unlink()
    d = only(_ckpt_codes(tmp, "acme/partial"), "E620")
    assert d.message.startswith('hf("acme/partial"), from the local Hugging Face cache (')
    assert "hf download acme/partial" in d.hint
    (snapshot / "pytorch_model.bin").write_bytes(b"\x80\x04")  # an old repository's pickle: downloading again won't do
    d = only(_ckpt_codes(tmp, "acme/partial"), "E620")
    assert "a PyTorch pickle" in d.message and "save_pretrained" in d.hint and "hf download" not in d.hint


# ---- user code -------------------------------------------------------------------------------------

REWARD_SRC = '''
import os as _os
from math import isclose as close_enough

MARKER = "imported"
open(_os.environ["FLOWRL_TEST_MARKER"], "w").write("ran")  # top-level code: must never run at check


def score(completions, answers):
    return [float(c == a) for c, a in zip(completions, answers)]


class Scorer:
    pass


try:
    import numpy as np
except ImportError:
    np = None
'''


@pytest.fixture
def rewards_module(tmp, monkeypatch):
    marker = tmp / "marker"
    monkeypatch.setenv("FLOWRL_TEST_MARKER", str(marker))
    (tmp / "my_rewards.py").write_text(REWARD_SRC)
    yield tmp
    assert not marker.exists(), "flowrl check ran the module's code"
    assert "my_rewards" not in sys.modules


def _reward(tmp: Path, ref: str, name: str = "f.flow") -> Path:
    return flow(tmp, f'model policy = tiny()\ndataset d = jsonl("data/train.jsonl")\n'
                     f'reward r = python_reward("{ref}")', name=name)


@pytest.mark.parametrize("attr", ["score", "Scorer", "MARKER", "close_enough", "np", "_os"])
def test_module_next_to_the_flow_file_defines_the_attribute(rewards_module, attr):
    assert codes_of(_reward(rewards_module, f"my_rewards:{attr}")) == []


def test_missing_attribute_names_the_module_and_close_names(rewards_module):
    d = only(codes_of(_reward(rewards_module, "my_rewards:scor")), "E606")
    assert d.message == f"module `my_rewards` ({rewards_module}/my_rewards.py) defines no `scor`"
    assert d.hint == "did you mean `score`, `Scorer`?"
    d = only(codes_of(_reward(rewards_module, "my_rewards:zzz")), "E606")
    assert d.hint.startswith("it defines `MARKER`, `Scorer`, `close_enough`, `np`, `score`")


def test_module_not_found_says_where_it_looked(rewards_module):
    d = only(codes_of(_reward(rewards_module, "my_reward:score")), "E605")
    assert d.message == "cannot find module `my_reward` (for `my_reward:score`)"
    assert d.hint == (f"looked in the flow file's folder {rewards_module}, then the folders on PYTHONPATH, "
                      "then installed packages; did you mean `my_rewards`?")


def test_module_is_looked_for_in_the_flow_files_folder_not_the_current_directory(rewards_module):
    """A flow in a subfolder does not see a module next to the current directory's flows."""
    sub = _reward(rewards_module, "my_rewards:score", name="sub/f.flow")
    write_jsonl(rewards_module / "sub" / "data" / "train.jsonl", ROWS)
    assert only(codes_of(sub, cwd=rewards_module), "E605")


def test_pythonpath_then_installed_packages(tmp, monkeypatch):
    lib = tmp / "lib" / "pkg" / "inner"
    lib.mkdir(parents=True)
    (lib / "rewards.py").write_text("def score(c, a):\n    return [0.0] * len(c)\n")  # a namespace package
    monkeypatch.setenv("PYTHONPATH", str(tmp / "elsewhere") + os.pathsep + str(tmp / "lib"))
    assert codes_of(_reward(tmp, "pkg.inner.rewards:score")) == []
    assert only(codes_of(_reward(tmp, "pkg.inner.rewards:nope")), "E606")
    assert codes_of(_reward(tmp, "json:loads")) == []  # installed (the standard library)
    assert only(codes_of(_reward(tmp, "json:not_there")), "E606").message.startswith("module `json` (/")


def test_star_import_and_module_getattr_accept_any_name(tmp):
    (tmp / "star.py").write_text("from json import *\n")
    (tmp / "lazy.py").write_text("def __getattr__(name):\n    return name\n")
    assert codes_of(_reward(tmp, "star:loads")) == []
    assert codes_of(_reward(tmp, "lazy:anything")) == []


def test_module_that_does_not_parse(tmp):
    (tmp / "broken.py").write_text("def score(:\n")
    d = only(codes_of(_reward(tmp, "broken:score")), "E605")
    assert d.message.startswith(f"module `broken` ({tmp}/broken.py) does not parse:") and "line 1" in d.message


@pytest.mark.parametrize("ref", ["score", "my_rewards:", ":score", "my rewards:score", "a..b:c"])
def test_not_module_colon_attribute(tmp, ref):
    d = only(codes_of(_reward(tmp, ref)), "E604")
    assert d.message.startswith('`python_reward` needs "module:function"')


def test_call_and_python_env_are_checked_too(tmp):
    (tmp / "filters.py").write_text("def keep(x):\n    return {'keep': [True]}\n")
    path = tmp / "c.flow"
    write_jsonl(tmp / "data" / "train.jsonl", ROWS)
    path.write_text('model policy = tiny()\ndataset d = jsonl("data/train.jsonl")\n'
                    "flow main() {\n  x = generate(policy, sample(d))\n"
                    '  y = call("filters:kep", x, produces = ["keep"])\n'
                    '  z = call("filters:kep", y, produces = ["keep"])\n  return z\n}\n')
    d = only(codes_of(path), "E606")  # one report for the two calls of the same function
    assert d.hint == "did you mean `keep`?"


# ---- models on their engines ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    """A tiny GPT-2 checkpoint's config (n_positions = 64) and character-level tokenizer; weights with no tensors."""
    from transformers import GPT2Config

    from flowrl.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("gpt2") / "gpt2"
    tok = build_tokenizer("0123456789+-=")
    cfg = GPT2Config(vocab_size=len(tok), n_embd=128, n_layer=2, n_head=4, n_positions=64,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    write_empty_weights(out)
    assert "max_position_embeddings" not in json.loads((out / "config.json").read_text())
    return out


def _gpt2_flow(tmp: Path, gpt2: Path, schedule: str = "", max_tokens: int = 8) -> Path:
    return flow(tmp, f'model policy = hf("{gpt2}")\ndataset d = jsonl("data/train.jsonl", eval = "data/test.jsonl")\n'
                     'reward r = verifier("exact")', max_tokens=max_tokens, schedule=schedule)


def test_gpt2_checks_clean_and_its_facts_come_from_n_positions(tmp, gpt2):
    path = _gpt2_flow(tmp, gpt2)
    assert codes_of(path) == []
    st = compile_file(str(path)).graph.sched
    facts = st.facts["policy"]
    assert (facts.architecture, facts.max_len, facts.positions_key) == ("GPT2LMHeadModel", 64, "n_positions")


def test_megatron_refuses_gpt2_with_what_to_use_instead(tmp, gpt2):
    sched = "schedule main on cluster(gpus_per_node = 2) {\n  policy.train = megatron(dp = 2)\n}\n"
    d = only(codes_of(_gpt2_flow(tmp, gpt2, sched)), "E607")
    assert d.message == (f"`policy` is a GPT2LMHeadModel ({gpt2}/config.json), which `megatron` does not run; "
                         "`megatron` runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                         "Qwen3MoeForCausalLM")
    assert d.span.line == 10  # the layout line, not the model
    assert d.hint == "give `policy.train` an engine that runs GPT2LMHeadModel: `torch(...)`"
    # fsdp wraps Llama-style layer stacks (model.model.layers): GPT-2's are model.transformer.h.
    sched = "schedule main on cluster(gpus_per_node = 2) {\n  policy.train = fsdp(dp = 2)\n}\n"
    assert "which `fsdp` does not run" in only(codes_of(_gpt2_flow(tmp, gpt2, sched)), "E607").message
    sched = "schedule main on cluster(gpus_per_node = 1) {\n  policy.train = torch(dp = 1)\n}\n"
    assert codes_of(_gpt2_flow(tmp, gpt2, sched)) == []


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_max_model_len_above_n_positions(tmp, gpt2, engine):
    sched = f"schedule main on cluster(gpus_per_node = 1) {{\n  policy.rollout = {engine}(max_model_len = 65)\n}}\n"
    d = only(codes_of(_gpt2_flow(tmp, gpt2, sched)), "E608")
    assert d.message == f"`max_model_len = 65` exceeds `policy`'s maximum positions: n_positions = 64 in {gpt2}/config.json"
    assert d.hint.endswith("write `max_model_len = 64` or less")
    sched = sched.replace("65", "64")
    assert codes_of(_gpt2_flow(tmp, gpt2, sched)) == []


def test_prompt_counted_with_the_checkpoints_tokenizer(tmp, gpt2):
    # First train row "12+30=": <bos> + 6 characters = 7 tokens; the eval split's first row the same.
    assert codes_of(_gpt2_flow(tmp, gpt2, max_tokens=57)) == []
    d = only(codes_of(_gpt2_flow(tmp, gpt2, max_tokens=58)), "E609")
    assert d.message == ("`max_tokens = 58` and the prompt (7 tokens in the first row of `data/train.jsonl`) exceed "
                         "the 64-token context of `policy`'s rollout engine `vllm` (the checkpoint's maximum "
                         "positions, n_positions = 64)")
    assert d.hint == "lower `max_tokens` to 57 or less"


def test_longer_eval_prompt_counts(tmp, gpt2):
    write_jsonl(tmp / "data" / "test.jsonl", [{"prompt": "1" * 20 + "=", "answer": "1"}])
    d = only(codes_of(_gpt2_flow(tmp, gpt2, max_tokens=57)), "E609")
    assert "22 tokens in the first row of `data/test.jsonl`" in d.message


def test_without_a_tokenizer_json_the_prompt_is_at_least_one_token(tmp, gpt2):
    bare = tmp / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((gpt2 / "config.json").read_text())
    write_empty_weights(bare)
    (bare / "tokenizer.model").write_bytes(b"")  # a SentencePiece model: not counted at check
    assert codes_of(_gpt2_flow(tmp, bare, max_tokens=63)) == []
    assert "(at least 1 token)" in only(codes_of(_gpt2_flow(tmp, bare, max_tokens=64)), "E609").message


def test_written_max_model_len_is_the_context(tmp, gpt2):
    sched = "schedule main on cluster(gpus_per_node = 1) {\n  policy.rollout = vllm(max_model_len = 32)\n}\n"
    d = only(codes_of(_gpt2_flow(tmp, gpt2, sched, max_tokens=30)), "E609")
    assert "the 32-token context" in d.message and "(`max_model_len = 32`)" in d.message
    assert d.hint == "lower `max_tokens` to 25 or less, or raise `max_model_len` (up to 64) in the schedule"


def test_hf_generate_is_bounded_by_the_positions(tmp, gpt2):
    sched = "schedule main on cluster(gpus_per_node = 1) {\n  policy.rollout = hf_generate()\n}\n"
    assert "the model's maximum positions, n_positions = 64" in \
        only(codes_of(_gpt2_flow(tmp, gpt2, sched, max_tokens=60)), "E609").message


def test_tiny_models_count_characters(tmp):
    # tiny(): 128 positions; "12+30=" is <bos> + 6 tokens.
    path = flow(tmp, TINY + 'dataset d = jsonl("data/train.jsonl")', max_tokens=121)
    assert codes_of(path) == []
    path = flow(tmp, TINY + 'dataset d = jsonl("data/train.jsonl")', max_tokens=122)
    assert "7 tokens in the first row" in only(codes_of(path), "E609").message


def test_large_context_defaults_to_the_cap():
    from flowrl.catalog.models import CONTEXT_CAP

    g = compile_text('model m = hf("meta-llama/Llama-3.1-8B")\nflow main(d: dataset) {\n'
                     "  x = generate(m, sample(d), max_tokens = 4095)\n  return x\n}\n", "doc.flow")
    assert g.sched.facts["m"].max_len == 131072 and CONTEXT_CAP == 4096
    with pytest.raises(FlowError) as e:
        compile_text('model m = hf("meta-llama/Llama-3.1-8B")\nflow main(d: dataset) {\n'
                     "  x = generate(m, sample(d), max_tokens = 4096)\n  return x\n}\n", "doc.flow")
    assert "the 4096-token context" in str(e.value) and "at most 4096 when `max_model_len` is not set" in str(e.value)


# ---- when the checks run ------------------------------------------------------------------------


def test_text_from_memory_is_checked_only_when_asked(tmp):
    text = TINY + 'dataset d = jsonl("nope.jsonl")' + GRPO_BODY.replace("MAX", "8")
    compile_text(text, str(tmp / "not_written.flow"))  # no file on disk: nothing to resolve against
    with pytest.raises(FlowError) as e:
        compile_text(text, str(tmp / "not_written.flow"), options={"resources": True})
    assert [d.code for d in e.value.diagnostics] == ["E601"]
    (tmp / "f.flow").write_text(text)
    compile_file(str(tmp / "f.flow"), options={"resources": False})


def test_check_imports_no_engine_and_no_pyarrow(tmp, gpt2):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), tmp / "ok.parquet")
    path = flow(tmp, f'model policy = hf("{gpt2}")\ndataset d = parquet("ok.parquet")\nreward r = verifier("exact")')
    probe = ("import sys; from flowrl.compiler.pipeline import check_file; check_file(sys.argv[1]); "
             "print(sorted(m for m in ('torch', 'ray', 'vllm', 'pyarrow', 'transformers', 'sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_shipped_flows_check_clean_from_any_directory():
    for path in sorted((ROOT / "flows").glob("*.flow")):
        diags = [d for d in codes_of(path, cwd=Path("/")) if d.code.startswith("E6")]
        assert diags == [], (path, [d.message for d in diags])


# ---- the runtime reads the same numbers --------------------------------------------------------


def test_runtime_context_reads_n_positions(gpt2, tmp):
    from flowrl.catalog.models import checkpoint_context

    assert checkpoint_context(gpt2) == 64
    (tmp / "llama").mkdir()
    (tmp / "llama" / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}))
    assert checkpoint_context(str(tmp / "llama")) == 4096
    (tmp / "none").mkdir()
    (tmp / "none" / "config.json").write_text("{}")
    assert checkpoint_context(tmp / "none") == 4096


def test_runtime_missing_dataset_names_the_flow_folder(tmp):
    from flowrl.data.datasets import DatasetError, load_rows

    with pytest.raises(DatasetError) as e:
        load_rows(tmp / "nope.jsonl", relative_to=tmp / "flows")
    assert f"resolved against the folder of the flow file that declares the dataset, {tmp / 'flows'}" in str(e.value)
    with pytest.raises(DatasetError) as e:
        load_rows(tmp / "nope.jsonl")
    assert "current directory" not in str(e.value)  # an absolute path is not relative to it
