"""hf_dataset sources (save_to_disk folders, shard folders, globs), templates and system prompts, mixtures,
and streamed reads: what is read and held, the order, and a resume that continues it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from flowrl.data.datasets import DatasetError
from flowrl.data.rows import RowFormat, TemplateError, render_prompt, template_slots
from flowrl.data.sampler import BatchSampler, MixSampler, RowsSampler, SamplerStateError, StreamSampler
from flowrl.data.sources import JsonlFiles, hf_files, hf_dataset

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _rows(n: int, start: int = 0) -> dict:
    return {"question": [f"{i}+1?" for i in range(start, start + n)], "solution": [str(i + 1) for i in range(start, start + n)]}


def _parquet(path: Path, n: int, start: int = 0, row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(_rows(n, start)), path, row_group_size=row_group_size)
    return path


def _jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _all(source) -> list:
    return [row for _, row in source.rows()]


# ---- save_to_disk ----------------------------------------------------------------------------------------


def test_a_saved_datasetdict_gives_each_split_as_data(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(_rows(2500)),
                               "test": datasets.Dataset.from_dict(_rows(3, start=9000))})
    dd.save_to_disk(str(tmp_path / "hf"))
    train = hf_dataset("hf", {"split": "train", "eval": "test"}, "train", str(tmp_path))
    assert train.columns() == ("question", "solution")
    assert len(train.blocks()) == 3  # 1000-row blocks of the Arrow file
    rows = _all(train)
    assert rows == [{"question": q, "solution": s} for q, s in zip(*_rows(2500).values())]
    assert train.head(2)[1] == (f"{tmp_path}/hf/train/data-00000-of-00001.arrow:2", {"question": "1+1?", "solution": "2"})
    held = hf_dataset("hf", {"split": "train", "eval": "test"}, "eval", str(tmp_path))
    assert [r["question"] for r in _all(held)] == ["9000+1?", "9001+1?", "9002+1?"]
    assert hf_dataset("hf", {"split": "train"}, "eval", str(tmp_path)) is None
    with pytest.raises(DatasetError, match=r"the DatasetDict has no split 'validation'; its splits: train, test"):
        hf_files(tmp_path / "hf", "validation")


def test_a_saved_dataset_alone_is_its_own_split(tmp_path):
    ds = datasets.Dataset.from_dict(_rows(5))
    ds.save_to_disk(str(tmp_path / "one"))
    files, kind = hf_files(tmp_path / "one", "train")
    assert kind == ".arrow" and len(_all(hf_dataset(str(tmp_path / "one"), {}, "train", "/"))) == 5
    # a split it was saved as is checked when the state records one
    state = json.loads((tmp_path / "one" / "state.json").read_text())
    (tmp_path / "one" / "state.json").write_text(json.dumps({**state, "_split": "test"}))
    with pytest.raises(DatasetError, match=r"a Dataset saved alone, of split 'test', not 'train'"):
        hf_files(tmp_path / "one", "train")


def test_a_state_json_cannot_point_outside_its_folder(tmp_path):
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../../etc/passwd"}]}))
    with pytest.raises(DatasetError, match="lists no data files"):
        hf_files(tmp_path / "evil", "train")


# ---- shards and globs ------------------------------------------------------------------------------------


def test_a_folder_of_parquet_shards_is_split_by_name(tmp_path):
    d = tmp_path / "data"
    _parquet(d / "train-00000-of-00002.parquet", 4)
    _parquet(d / "train-00001-of-00002.parquet", 3, start=4, row_group_size=2)
    _parquet(d / "test-00000-of-00001.parquet", 2, start=100)
    files, kind = hf_files(d, "train")
    assert [f.name for f in files] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    train = hf_dataset("data", {"split": "train", "eval": "test"}, "train", str(tmp_path))
    assert [r["question"] for r in _all(train)] == [f"{i}+1?" for i in range(7)]
    assert len(train.blocks()) == 1 + 2  # one row group, then two of 2 rows
    assert [r["question"] for r in _all(hf_dataset("data", {"eval": "test"}, "eval", str(tmp_path)))] == ["100+1?", "101+1?"]
    with pytest.raises(DatasetError, match=r"no shards of split 'validation'.*splits found: test, train"):
        hf_files(d, "validation")


def test_split_folders_and_unnamed_shards(tmp_path):
    _jsonl(tmp_path / "a" / "train" / "part-0.jsonl", [{"question": "x", "solution": "1"}])
    _jsonl(tmp_path / "a" / "validation" / "part-0.jsonl", [{"question": "y", "solution": "2"}])
    assert [f.parent.name for f in hf_files(tmp_path / "a", "validation")[0]] == ["validation"]
    _jsonl(tmp_path / "b" / "part-0.jsonl", [{"question": "x", "solution": "1"}])
    _jsonl(tmp_path / "b" / "part-1.jsonl", [{"question": "y", "solution": "2"}])
    assert len(hf_files(tmp_path / "b", "train")[0]) == 2  # no split names: every shard trains
    (tmp_path / "c").mkdir()
    _parquet(tmp_path / "c" / "train-0.parquet", 1)
    _jsonl(tmp_path / "c" / "train-1.jsonl", [{"question": "y", "solution": "2"}])
    with pytest.raises(DatasetError, match=r"mixes shard formats"):
        hf_files(tmp_path / "c", "train")


def test_a_glob_of_jsonl_shards_and_its_eval_glob(tmp_path):
    for k in range(3):
        _jsonl(tmp_path / "data" / f"train-{k}.jsonl", [{"question": f"{k}-{i}", "solution": "0"} for i in range(2)])
    _jsonl(tmp_path / "data" / "dev-0.jsonl", [{"question": "held", "solution": "0"}])
    train = hf_dataset("data/train-*.jsonl", {"eval": "data/dev-*.jsonl"}, "train", str(tmp_path))
    assert [r["question"] for r in _all(train)] == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]
    assert [r["question"] for r in _all(hf_dataset("data/train-*.jsonl", {"eval": "data/dev-*.jsonl"}, "eval",
                                                str(tmp_path)))] == ["held"]
    with pytest.raises(DatasetError, match=r"no file matches the glob"):
        hf_dataset("data/nope-*.parquet", {}, "train", str(tmp_path))
    # one shard named alone: `eval` names a file too, never the training one again
    one = hf_dataset("data/train-0.jsonl", {"eval": "data/dev-0.jsonl"}, "eval", str(tmp_path))
    assert [r["question"] for r in _all(one)] == ["held"]


# ---- templates and system prompts ------------------------------------------------------------------------


def test_a_template_writes_the_prompt_from_the_row():
    fmt = RowFormat(fields=("solution",), template="Question: {question}\nContext: {ctx}\nAnswer:")
    row = fmt.check("d:1", {"question": "2+2?", "ctx": {"unit": "apples"}, "solution": 4})
    assert row["prompt"] == 'Question: 2+2?\nContext: {"unit": "apples"}\nAnswer:'
    assert fmt.needs() == ("question", "ctx", "solution")
    with pytest.raises(DatasetError, match=r"d:2: missing field 'ctx' \(a slot of the template\)"):
        fmt.check("d:2", {"question": "x", "solution": 1})
    assert RowFormat(template="{{literal}} {x}").check("d:3", {"x": "v", "answer": 1})["prompt"] == "{literal} v"
    for bad in ("{x.attr}", "{x[0]}", "{x!r}", "{x:>3}", "{}", "unclosed {x", "a } b"):
        with pytest.raises(TemplateError):
            template_slots(bad)


def _tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>")),
                                  unk_token="<unk>", eos_token="</s>")
    tok.chat_template = chat_template
    return tok


CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_system_and_template_go_through_the_chat_template_where_there_is_one():
    with_template, plain = _tokenizer(CHAT), _tokenizer(None)
    assert render_prompt(with_template, "Q: 2+2?", chat=False, chat_auto=True, system="Be brief.") == \
        "<|system|>Be brief.\n<|user|>Q: 2+2?\n<|assistant|>"
    assert render_prompt(plain, "Q: 2+2?", chat=False, chat_auto=True, system="Be brief.") == "Be brief.\n\nQ: 2+2?"
    assert render_prompt(with_template, "Q: 2+2?", chat=False, chat_auto=False, system="") == "Q: 2+2?"
    # chat = false forces text even where the tokenizer has a template
    assert render_prompt(with_template, "Q", chat=False, chat_auto=False, system="S") == "S\n\nQ"
    # a messages prompt that has its own system message keeps it
    msgs = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}]
    assert render_prompt(with_template, msgs, chat=True, system="Other.") == "<|system|>Mine.\n<|user|>Hi\n<|assistant|>"


# ---- mixtures --------------------------------------------------------------------------------------------


def test_a_mixture_draws_with_its_weights_deterministically_and_resumes():
    def mixture(seed=3):
        return MixSampler([RowsSampler([("a", i) for i in range(50)], 8, seed=1),
                           RowsSampler([("b", i) for i in range(7)], 8, seed=2),
                           RowsSampler([("c", i) for i in range(9)], 8, seed=4)], [0.6, 0.3, 0.1], seed=seed)

    m = mixture()
    drawn = [r for _ in range(500) for r in m.take(8)]
    share = Counter(src for src, _ in drawn)
    n = len(drawn)
    # 4000 draws: each share within 4 standard deviations of its weight
    for src, w in (("a", 0.6), ("b", 0.3), ("c", 0.1)):
        assert abs(share[src] / n - w) < 4 * (w * (1 - w) / n) ** 0.5, (src, share[src] / n)
    # within a part, rows come in its own epochs: each of b's 7 rows equally often
    assert len({c for (src, i), c in Counter(drawn).items() if src == "b"}) <= 2
    again = mixture()
    assert [r for _ in range(500) for r in again.take(8)] == drawn
    assert [r for _ in range(50) for r in mixture(seed=4).take(8)] != drawn[:400]
    first = mixture()
    first.take(8), first.take(8)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = mixture()
    resumed.load_state_dict(state)
    assert resumed.take(8) == first.take(8) == drawn[16:24]
    with pytest.raises(SamplerStateError, match="weights"):
        MixSampler([RowsSampler([1], 1), RowsSampler([2], 1)], [1, 1], seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="each >= 0"):
        MixSampler([RowsSampler([1], 1)], [-1])


# ---- streaming -------------------------------------------------------------------------------------------


def _big_jsonl(path: Path, n: int) -> Path:
    # ~100 bytes a row; rows straddle the 4 KiB block boundaries
    return _jsonl(path, [{"question": f"{i}+1?" + "x" * (i % 90), "solution": str(i + 1)} for i in range(n)])


def test_streaming_reads_and_holds_a_window_not_the_file(tmp_path):
    path = _big_jsonl(tmp_path / "big.jsonl", 20_000)
    size = path.stat().st_size
    source = JsonlFiles([path], block_bytes=4096)
    s = StreamSampler(source, lambda where, row: row, seed=5, window=2)
    first = s.take(16)
    assert source.bytes_read <= 2 * 4096 + 2 * 200  # two blocks (and the row ending each)
    assert s.held <= 2 * 4096 // 50 and size > 100 * source.bytes_read
    # every row once per epoch, rows split by block boundaries included, never two at a time held
    seen, most = list(first), s.held
    while len(seen) < 20_000:
        seen += s.take(97)
        most = max(most, s.held)
    assert sorted(int(r["solution"]) for r in seen[:20_000]) == list(range(1, 20_001))
    assert most <= 2 * 4096 // 50
    assert s.epoch == 1  # the batch that finished the epoch went on into the next


def test_streaming_order_is_seeded_and_a_resume_continues_it(tmp_path):
    path = _big_jsonl(tmp_path / "big.jsonl", 3_000)

    def sampler(seed=5):
        return StreamSampler(JsonlFiles([path], block_bytes=4096), lambda w, r: r["question"], seed=seed, window=3)

    a = sampler()
    drawn = [a.take(10) for _ in range(40)]
    b = sampler()
    assert [b.take(10) for _ in range(40)] == drawn
    assert sampler(seed=6).take(10) != drawn[0]
    assert drawn[0] != sorted(drawn[0])  # shuffled within the window
    part = sampler()
    for _ in range(17):
        part.take(10)
    state = json.loads(json.dumps(part.state_dict()))
    resumed = sampler()
    resumed.load_state_dict(state)
    assert [resumed.take(10) for _ in range(23)] == drawn[17:]
    other = StreamSampler(JsonlFiles([path], block_bytes=8192), lambda w, r: r, seed=5, window=3)
    with pytest.raises(SamplerStateError, match="blocks"):
        other.load_state_dict(state)
    with pytest.raises(SamplerStateError, match="saved by a sampler of rows held whole"):
        sampler().load_state_dict(BatchSampler(10, 2).state_dict())
    with pytest.raises(SamplerStateError, match="saved by a streamed sampler"):
        BatchSampler(10, 2, seed=5).load_state_dict(state)


def test_streamed_bad_rows_are_skipped_or_refused_where_they_are(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "a", "solution": "1"}, "not json", {"question": "b"},
                                         {"question": "c", "solution": "3"}])
    fmt = RowFormat("question", ("solution",))
    skipped = []

    def lenient(where, raw):
        try:
            return fmt.check(where, raw) if not isinstance(raw, DatasetError) else (_ for _ in ()).throw(raw)
        except DatasetError as e:
            skipped.append(str(e))
            return None

    s = StreamSampler(JsonlFiles([path], block_bytes=1 << 20), lenient, seed=0, window=1)
    assert sorted(r["question"] for r in s.take(6)) == ["a", "a", "a", "c", "c", "c"]  # three epochs
    assert len(skipped) >= 4  # met as they are drawn: both bad rows in each of the first two epochs
    assert {m.split(" (")[0].split(";")[0] for m in skipped} == {f"{path}@byte 35: invalid JSON",
                                                                f"{path}@byte 44: missing field 'solution'"}
    strict = StreamSampler(JsonlFiles([path]), lambda w, r: fmt.check(w, r) if not isinstance(r, DatasetError)
                           else (_ for _ in ()).throw(r), seed=0, window=1)
    with pytest.raises(DatasetError, match=r"d\.jsonl@byte (35: invalid JSON|44: missing field 'solution')"):
        strict.take(3)  # an epoch has two good rows: the third is past a bad one


def test_a_row_longer_than_the_limit_is_a_bad_row_not_read_whole(tmp_path, monkeypatch):
    import flowrl.data.sources as sources

    monkeypatch.setattr(sources, "MAX_ROW_BYTES", 1000)
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "a", "solution": "1"}, {"question": "x" * 5000, "solution": "2"},
                                         {"question": "c", "solution": "3"}])
    rows = list(JsonlFiles([path]).rows())
    assert [r["question"] for _, r in rows if isinstance(r, dict)] == ["a", "c"]
    assert "a row longer than 1,000 bytes" in str(rows[1][1]) and rows[1][0] == f"{path}:2"
