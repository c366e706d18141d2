"""A flow from someone else (a pull request checked in CI) cannot make the compiler show a file.

Imports name `.flow` modules: any other path is refused by its name and type before it is
opened (E131); entry files likewise (E124). Datasets, model configs and the like are read as
data: their errors say where (file, line) and what is wrong, never the text. Every verb that
compiles (check, plan, fmt, ir, graph) is run in-process through the CLI on each case; a
secret planted in each file never appears in what it prints, every error has a position and a
hint, and a FIFO or a device never blocks or grows the compiler.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from flowrl.catalog.models import ConfigError, read_config
from flowrl.cli import main
from flowrl.data.datasets import DatasetError, check_head, head_rows

SECRET = "SECRET=abcd1234deadbeef5eed"
VERBS = (["check"], ["plan"], ["ir"], ["graph"])
FLOW = """model m = tiny()
dataset d = jsonl({data})
reward r = verifier("math")
flow main() {{
  b = sample(d, size = 2)
  x = generate(m, b, n = 2, max_tokens = 4)
  s = r(x)
  return s
}}
"""


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A folder of files that hold a secret or are not files at all; the current directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLOWRL_TEST_SECRET", SECRET)  # /proc/self/environ holds it too
    (tmp_path / "secret.txt").write_text(f"{SECRET}\n")
    (tmp_path / "secret.jsonl").write_text(f"{SECRET}\n")
    (tmp_path / "late.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' + f"{SECRET}\n")
    (tmp_path / "keyed.jsonl").write_text(json.dumps({"prompt": 7, "answer": SECRET}) + "\n")
    (tmp_path / "secret.parquet").write_text(f"{SECRET}\n")
    os.symlink("secret.txt", tmp_path / "link.flow")
    os.symlink("secret.txt", tmp_path / "link.jsonl")
    os.mkfifo(tmp_path / "pipe.flow")
    os.mkfifo(tmp_path / "pipe.jsonl")
    (tmp_path / "folder.flow").mkdir()
    return tmp_path


def _run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out + err


def _assert_clean_errors(code: int, text: str) -> None:
    """Refused, with a position and a hint, and nothing of the secret."""
    assert code != 0, text
    assert SECRET not in text and "abcd1234" not in text, text
    errors = re.findall(r"^(\S+):(\d+):(\d+): error\[E\d{3}\]", text, flags=re.M)
    assert errors, text
    assert "= hint:" in text, text
    assert "Traceback" not in text and "internal error" not in text, text


IMPORTS = ["/etc/passwd", "/proc/self/environ", "/dev/zero", "secret.txt", "link.flow", "pipe.flow", "folder.flow",
           "secret.jsonl"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", IMPORTS)
def test_an_import_of_anything_but_a_flow_file_is_refused_unread(planted, capsys, target):
    (planted / "main.flow").write_text(f'import "{target}"\n\nflow main() {{}}\n')
    for verb in VERBS:
        code, text = _run([*verb, "main.flow"], capsys)
        _assert_clean_errors(code, text)
        assert "main.flow:1:1: error[E131]" in text, text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ["secret.txt", "link.flow", "pipe.flow", "/proc/self/environ"])
def test_an_entry_file_that_is_not_a_flow_file_is_refused_unread(planted, capsys, entry):
    for verb in [*VERBS, ["fmt"], ["fmt", "--check"]]:
        code, text = _run([*verb, entry], capsys)
        _assert_clean_errors(code, text)
        assert "error[E124]" in text, text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("data", ['"secret.jsonl"', '"late.jsonl", eval = "secret.jsonl"', '"keyed.jsonl"',
                                  '"link.jsonl"', '"pipe.jsonl"', '"/dev/zero"', '"/proc/self/environ"',
                                  '"/etc/passwd"', '"secret.jsonl", bad_rows = "skip"'])
def test_a_dataset_holding_a_secret_is_reported_without_it(planted, capsys, data):
    (planted / "main.flow").write_text(FLOW.format(data=data))
    for verb in VERBS:
        code, text = _run([*verb, "main.flow"], capsys)
        _assert_clean_errors(code, text)
        assert re.search(r"main\.flow:2:\d+: error\[E602\]", text), text


@pytest.mark.timeout(120)
def test_a_parquet_dataset_holding_a_secret_is_reported_without_it(planted, capsys):
    (planted / "main.flow").write_text(FLOW.format(data='"x.jsonl"').replace('jsonl("x.jsonl")',
                                                                            'parquet("secret.parquet")'))
    code, text = _run(["check", "main.flow"], capsys)
    _assert_clean_errors(code, text)
    assert "error[E602]" in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", [
    f"{SECRET}\n",
    json.dumps({"model_type": "llama", "hidden_size": SECRET, "num_hidden_layers": 2, "num_attention_heads": 2,
                "vocab_size": 10}),
    json.dumps({"architectures": [SECRET], "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                "vocab_size": 10}),
    "link", "pipe"])
def test_a_model_config_holding_a_secret_is_reported_without_it(planted, capsys, config):
    (planted / "model").mkdir()
    target = planted / "model" / "config.json"
    if config == "link":
        os.symlink(planted / "secret.txt", target)
    elif config == "pipe":
        os.mkfifo(target)
    else:
        target.write_text(config)
    (planted / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (planted / "main.flow").write_text(FLOW.format(data='"data.jsonl"').replace("tiny()", 'hf("model")'))
    for verb in VERBS:
        code, text = _run([*verb, "main.flow"], capsys)
        _assert_clean_errors(code, text)
        assert re.search(r"main\.flow:1:\d+: error\[E6\d\d\]", text), text


@pytest.mark.timeout(60)
def test_readers_refuse_pipes_and_devices_without_blocking(planted):
    """The readers the checks share: a FIFO or a device is refused once opened, not read."""
    for path in (planted / "pipe.jsonl", "/dev/zero"):
        with pytest.raises(DatasetError, match="not a regular file"):
            check_head(path, format=".jsonl")
        assert head_rows(str(path), format=".jsonl") == []
    with pytest.raises(ConfigError):
        read_config(planted / "pipe.flow")
    with pytest.raises(ConfigError):
        read_config("/dev/zero")


def test_a_line_longer_than_a_check_reads_is_refused_by_its_length(planted):
    big = planted / "big.jsonl"
    with open(big, "wb") as f:
        f.write(b'{"prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}\n')
    with pytest.raises(DatasetError, match="no complete good row in the first"):
        check_head(big, answer_fields=())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tamper", ["metrics", "plan-pipe", "plan-secret", "trace-link"])
def test_a_run_directory_for_measured_is_read_as_data(planted, capsys, tamper):
    """`flowrl plan --gantt --measured RUN`: a run directory from someone else is read as bounded
    data; what is wrong is said without its values."""
    run = planted / "run"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"ops": [], "staleness": 1}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "perf/step_s": 1.0}) + "\n")
    (run / "trace.json").write_text(json.dumps({"traceEvents": []}))
    if tamper == "metrics":
        (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "perf/step_s": SECRET}) + "\n"
                                           + json.dumps({"step": 3, "perf/step_s": SECRET}) + "\n")
    elif tamper == "plan-pipe":
        (run / "plan.json").unlink()
        os.mkfifo(run / "plan.json")
    elif tamper == "plan-secret":
        (run / "plan.json").write_text(f"{SECRET}\n")
    else:
        (run / "trace.json").unlink()
        os.symlink("/dev/zero", run / "trace.json")
    (planted / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (planted / "main.flow").write_text(FLOW.format(data='"data.jsonl"'))
    code, text = _run(["plan", "main.flow", "--gantt", str(planted / "g.png"), "--measured", str(run)], capsys)
    assert code == 1, text
    assert SECRET not in text and "abcd1234" not in text and "internal error" not in text, text
    assert "flowrl: error:" in text and "hint:" in text, text


@pytest.mark.timeout(60)
def test_a_chat_template_probe_never_blocks_on_a_pipe(planted):
    from flowrl.data.chat import template_source

    (planted / "model").mkdir()
    os.mkfifo(planted / "model" / "tokenizer_config.json")
    assert template_source(planted / "model") is None


@pytest.mark.timeout(120)
def test_a_reward_module_is_read_never_run(planted, capsys):
    """`python_reward("mod:fn")`: check reads the module's names with `ast`; its code never runs and
    its values never show."""
    marker = planted / "ran"
    (planted / "mod.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
                                    f"TOKEN = {SECRET!r}\n")
    (planted / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (planted / "main.flow").write_text(FLOW.format(data='"data.jsonl"').replace('verifier("math")',
                                                                              'python_reward("mod:score")'))
    for verb in VERBS:
        code, text = _run([*verb, "main.flow"], capsys)
        _assert_clean_errors(code, text)
        assert "error[E606]" in text and "TOKEN" in text, text  # the names it defines, not their values
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_the_command_line_never_shows_the_environment(planted):
    """The real `flowrl` process, with a secret in its environment: importing /proc/self/environ is
    refused by name, and nothing of the environment reaches its output."""
    import subprocess
    import sys

    (planted / "main.flow").write_text('import "/proc/self/environ"\nimport "link.flow"\n\nflow main() {}\n')
    env = {**os.environ, "FLOWRL_TEST_SECRET": SECRET}
    for verb in ("check", "ir", "graph", "plan"):
        proc = subprocess.run([sys.executable, "-m", "flowrl.cli", verb, "main.flow"], cwd=planted, env=env,
                              capture_output=True, text=True, timeout=100)
        assert proc.returncode == 1, proc.stderr
        assert SECRET not in proc.stdout + proc.stderr and "abcd1234" not in proc.stdout + proc.stderr
        assert proc.stderr.count("error[E131]") == 2 and "Traceback" not in proc.stderr, proc.stderr
