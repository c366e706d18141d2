"""flowrl.sandbox: what a sandboxed program cannot do, one test per escape.

Each test runs a hostile program, checks that nothing escaped, that no process of the
run is left, and that the pool still serves. The same file runs as root (uid per worker)
and as an unprivileged user (``test_unprivileged.py`` re-runs it as ``nobody``); a test that
needs a layer the machine cannot give skips and names the layer's own reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from flowrl.sandbox import Limits, SandboxError, SandboxPool, procs

LIMITS = Limits(timeout_s=2.0, output_bytes=1 << 16, scratch_mb=8, file_size_mb=4, processes=32, scratch_files=500)


@pytest.fixture(scope="module", params=["bubblewrap", "no-bubblewrap"])
def pool(request):
    """Every test runs with all layers, and again without bubblewrap (the fallback path)."""
    with SandboxPool(2, limits=LIMITS, use_bubblewrap=request.param == "bubblewrap") as p:
        yield p


def _layer(pool, name):
    return next(layer for layer in pool.layers if layer.name == name)


def need(pool, *names):
    """Skip unless every named layer is active (the reason is the layer's own detail)."""
    for name in names:
        layer = _layer(pool, name)
        if not layer.active:
            pytest.skip(f"isolation layer {name!r} is not active here: {layer.detail}")


def leftovers(pool) -> list[int]:
    """Processes of any worker's runs that are still there (descendants, or its uid's)."""
    out = [p for w in pool.worker_pids() for p in procs.descendants(w)]
    for cfg in pool._configs:
        if cfg.uid is not None and procs.uid_has_processes(cfg.uid):
            out.append(cfg.uid)
    return out


def contained(pool):
    """Nothing of earlier runs is alive, and the pool still runs a program correctly."""
    assert leftovers(pool) == []
    assert pool.run("print('still serving')").stdout == "still serving\n"


# ---- the layers, each on its own ----------------------------------------------------------


def test_self_check_names_every_layer(pool):
    names = [layer.name for layer in pool.layers]
    assert names == ["uid", "rlimits", "network", "seccomp", "filesystem", "files", "environment", "process tree",
                     "output"]
    inactive = {layer.name for layer in pool.layers if not layer.active}
    expected = set()
    if os.geteuid() != 0:
        expected.add("uid")
        assert "not root" in _layer(pool, "uid").detail
    if pool._configs[0].bwrap is None:
        expected.add("filesystem")
        assert "switched off by the caller" in _layer(pool, "filesystem").detail
    elif not shutil.which("bwrap"):
        expected.add("filesystem")
    # `make test` installs bubblewrap when root; every other layer must hold on this machine.
    assert inactive == expected, [str(layer) for layer in pool.layers if not layer.active]


def test_inactive_layers_are_logged_as_warnings(monkeypatch, caplog):
    from flowrl.sandbox import pool as pool_module

    monkeypatch.setattr(pool_module, "_REPORTED", set())
    with caplog.at_level("WARNING", logger="flowrl.sandbox"):
        with SandboxPool(1, use_bubblewrap=False) as p:
            assert p.run("print(1)").stdout == "1\n"
    assert "isolation layer 'filesystem' is NOT active: bubblewrap switched off by the caller" in caplog.text


def test_failing_bubblewrap_falls_back_and_says_why(monkeypatch):
    from dataclasses import replace

    from flowrl.sandbox import pool as pool_module

    real = pool_module._static_config
    monkeypatch.setattr(pool_module, "_static_config", lambda *a: replace(real(*a), bwrap="/usr/bin/false"))
    with SandboxPool(1) as p:
        layer = _layer(p, "filesystem")
        assert not layer.active and "bubblewrap fails here" in layer.detail
        assert p.run("print(2)").stdout == "2\n"  # the fallback path serves
        assert _layer(p, "network").active and _layer(p, "seccomp").active


def test_uid_is_unprivileged_and_per_worker(pool):
    need(pool, "uid")
    uids = {int(pool.run("import os; print(os.getuid())").stdout) for _ in range(8)}
    assert uids <= {cfg.uid for cfg in pool._configs} and all(u >= 1000 for u in uids)
    assert len({cfg.uid for cfg in pool._configs}) == len(pool._configs)


def test_rlimits_are_set(pool):
    res = pool.run("import resource as r\n"
                   "print([r.getrlimit(x)[0] for x in (r.RLIMIT_AS, r.RLIMIT_FSIZE, r.RLIMIT_NOFILE, r.RLIMIT_CORE)])\n"
                   "print(list(r.getrlimit(r.RLIMIT_CPU)))", timeout_s=2.5)
    limits, cpu = res.stdout.splitlines()
    assert json.loads(limits) == [LIMITS.memory_mb << 20, LIMITS.file_size_mb << 20, LIMITS.open_files, 0]
    assert json.loads(cpu) == [4, 5]  # ceil(2.5) + 1 s; SIGKILL one second after SIGXCPU


def test_network_namespace_has_only_loopback(pool):
    need(pool, "network")
    res = pool.run("print([l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]])")
    assert res.stdout.strip() == "['lo']"


def test_seccomp_denies_sockets_and_ptrace(pool):
    need(pool, "seccomp")
    res = pool.run("import ctypes, os, socket\n"
                   "try:\n    socket.socket(socket.AF_UNIX)\nexcept OSError as e:\n    print('socket', e.errno)\n"
                   "libc = ctypes.CDLL(None, use_errno=True)\n"
                   "print('ptrace', libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"   # PTRACE_TRACEME
                   "print('unshare', libc.unshare(0x40000000), ctypes.get_errno())")
    assert res.stdout.split("\n")[:3] == ["socket 1", "ptrace -1 1", "unshare -1 1"], res


def test_environment_is_scrubbed(pool, monkeypatch):
    monkeypatch.setenv("FLOWRL_SANDBOX_SECRET", "hunter2")
    res = pool.run("import os; print(sorted(os.environ))")
    env = set(eval(res.stdout))  # noqa: S307 - our own program's repr
    assert env <= {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE",
                   "HOME", "TMPDIR", "PWD"}


# ---- hostile programs -----------------------------------------------------------------------


def test_infinite_loop_is_stopped_at_the_deadline(pool):
    res = pool.run("while True:\n    pass", timeout_s=1.0)
    assert res.timed_out and res.killed_signal == signal.SIGKILL and res.exit_code == -signal.SIGKILL
    contained(pool)


def test_sleep_is_stopped_at_the_deadline(pool):
    res = pool.run("import time\nprint('before', flush=True)\ntime.sleep(60)\nprint('after')", timeout_s=1.0)
    assert res.timed_out and res.stdout == "before\n"
    contained(pool)


def test_fork_bomb_stops_at_the_process_limit(pool):
    src = ("import os, time\nn = 0\nfor _ in range(10000):\n    try:\n        os.fork()\n        n += 1\n"
           "    except OSError as e:\n        print('fork failed', e.errno, flush=True)\n        break\n"
           "time.sleep(60)")
    res = pool.run(src, timeout_s=1.5)
    assert res.timed_out
    assert "fork failed 11" in res.stdout  # EAGAIN: RLIMIT_NPROC
    contained(pool)


def test_thread_bomb_stops_at_the_process_limit(pool):
    src = ("import threading, time\nn = 0\ntry:\n    while True:\n"
           "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n        n += 1\n"
           "except RuntimeError as e:\n    print('threads', n, e)")
    res = pool.run(src)
    assert res.exit_code == 0 and "can't start new thread" in res.stdout
    assert int(res.stdout.split()[1]) < LIMITS.processes
    contained(pool)


def test_memory_hog_gets_memory_error(pool):
    res = pool.run("x = bytearray(10 ** 10)")
    assert res.memory_exceeded and res.exit_code == 1 and "MemoryError" in res.stderr
    res = pool.run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", memory_mb=64)
    assert res.memory_exceeded and not res.timed_out
    contained(pool)


def test_big_file_stops_at_the_file_size_limit(pool):
    res = pool.run("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))")
    assert res.exit_code == 1 and "File too large" in res.stderr
    contained(pool)


def test_many_files_stop_at_the_scratch_size(pool, tmp_path):
    need(pool, "files")
    src = ("import os\ni = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n    i += 1")
    res = pool.run(src, timeout_s=10.0)
    assert res.exit_code == 1 and "No space left on device" in res.stderr and not res.timed_out
    assert res.scratch_full
    for d in ("/tmp", "/dev/shm"):  # the host's world-writable directories got nothing
        assert not any(name.startswith("f") and name[1:].isdigit() for name in os.listdir(d))
    contained(pool)


def test_empty_directories_stop_at_the_file_cap(pool):
    """Each inode costs kernel memory whatever its size: a create loop stops at ``scratch_files``
    (ENOSPC), in the scratch directory and in every world-writable directory it can reach, and
    the result says so; nothing lands in the host's directories."""
    need(pool, "files")
    marker = f"flowrl-inode-{os.getpid()}-"
    src = ("import errno, os, sys\nmarker = sys.stdin.read()\n"
           "places = [d for d in ('.', '/tmp', '/var/tmp', '/dev/shm', '/run/lock') if os.path.isdir(d)]\n"
           "n = 0\ntry:\n    while True:\n        os.mkdir(os.path.join(places[n % len(places)], marker + str(n)))\n"
           "        n += 1\nexcept OSError as e:\n    print(n, errno.errorcode[e.errno])")
    res = pool.run(src, stdin=marker, timeout_s=10.0)
    count, err = res.stdout.split()
    assert err == "ENOSPC" and 0 < int(count) <= LIMITS.scratch_files and res.exit_code == 0 and not res.timed_out
    assert res.files_limit == LIMITS.scratch_files and res.files_exceeded and not res.scratch_full
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(d):
            assert not any(name.startswith(marker) for name in os.listdir(d)), d
    ok = pool.run("open('a', 'w').write('x')")  # the next run starts with an empty scratch again
    assert ok.ok and ok.files_limit == LIMITS.scratch_files and not ok.files_exceeded
    contained(pool)


def test_loopback_listener_on_the_host_is_unreachable(pool):
    need(pool, "network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        src = (f"import socket\nfor host in ('127.0.0.1', 'localhost'):\n    try:\n"
               f"        socket.create_connection((host, {port}), timeout=1)\n        print('CONNECTED')\n"
               f"    except OSError as e:\n        print('refused', type(e).__name__)")
        res = pool.run(src)
        with pytest.raises(socket.timeout):
            server.accept()
    assert "CONNECTED" not in res.stdout and res.stdout.count("refused") == 2
    contained(pool)


def test_host_files_are_invisible(pool):
    need(pool, "filesystem")
    project = os.path.dirname(os.path.abspath(__file__))
    paths = [__file__, project, "/root", "/etc/shadow", "/etc/passwd", "/work", "/home"]
    src = ("import json, os, sys\nout = {}\nfor p in json.loads(sys.stdin.read()):\n    try:\n"
           "        out[p] = open(p, 'rb').read(10).hex() if os.path.isfile(p) else os.listdir(p)\n"
           "    except OSError as e:\n        out[p] = e.errno\nprint(json.dumps(out))")
    seen = json.loads(pool.run(src, stdin=json.dumps(paths)).stdout)
    assert seen == {p: 2 for p in paths}  # ENOENT: not there at all
    contained(pool)


def test_parent_environment_is_unreadable(pool, monkeypatch):
    monkeypatch.setenv("FLOWRL_SANDBOX_SECRET", "hunter2")
    if not (_layer(pool, "uid").active or _layer(pool, "filesystem").active):
        pytest.skip("neither a uid of its own nor a pid namespace: the program could read its parent's environ")
    pids = [os.getpid(), os.getppid(), *pool.worker_pids()]
    src = ("import os, json, sys\nfound = []\nfor p in json.loads(sys.stdin.read()) + "
           "[int(d) for d in os.listdir('/proc') if d.isdigit()]:\n    try:\n"
           "        found.append(open(f'/proc/{p}/environ', 'rb').read().decode(errors='replace'))\n"
           "    except OSError:\n        pass\nprint('\\n'.join(found)); print(dict(os.environ))")
    res = pool.run(src, stdin=json.dumps(pids))
    assert res.exit_code == 0 and "hunter2" not in res.stdout
    contained(pool)


def test_writes_outside_scratch_do_not_land(pool, tmp_path):
    need(pool, "filesystem")
    host = tmp_path / "shared"
    host.mkdir()
    host.chmod(0o777)  # writable by the sandbox's uid, were it visible
    target = host / "victim.txt"
    target.write_text("original")
    target.chmod(0o666)
    src = (
        "import os, sys\nt = sys.stdin.read()\nout = []\n"
        "def attempt(name, fn):\n    try:\n        fn()\n        out.append(name + ' ok')\n"
        "    except OSError as e:\n        out.append(f'{name} {e.errno}')\n"
        "attempt('direct', lambda: open(t, 'w').write('pwned'))\n"
        "attempt('new', lambda: open(os.path.join(os.path.dirname(t), 'new.txt'), 'w').write('pwned'))\n"
        "os.symlink(t, 'link')\nattempt('symlink', lambda: open('link', 'w').write('pwned'))\n"
        "attempt('hardlink', lambda: os.link(t, 'hard'))\n"
        "attempt('dotdot', lambda: open('../../../../' + t, 'w').write('pwned'))\n"
        "for p in ('/usr/pwned', '/pwned', '/etc/pwned', '/proc/pwned', '/dev/pwned'):\n"
        "    attempt(p, lambda: open(p, 'w').write('pwned'))\n"
        "attempt('scratch', lambda: open('mine.txt', 'w').write('fine'))\nprint('\\n'.join(out))")
    res = pool.run(src, stdin=str(target))
    lines = res.stdout.splitlines()
    assert lines[-1] == "scratch ok" and not any(line.endswith(" ok") for line in lines[:-1]), lines
    assert target.read_text() == "original" and sorted(p.name for p in host.iterdir()) == ["victim.txt"]
    for p in ("/usr/pwned", "/pwned", "/etc/pwned"):
        assert not os.path.exists(p)
    contained(pool)


def test_signals_and_ptrace_cannot_reach_other_processes(pool):
    victim = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline() == "up\n"  # started: its state below is its own, not a start-up's
        if not (_layer(pool, "uid").active or _layer(pool, "filesystem").active):
            pytest.skip("neither a uid of its own nor a pid namespace: the program may signal its caller's processes")
        src = ("import ctypes, os, signal, sys\npid = int(sys.stdin.read())\n"
               "for sig in (signal.SIGKILL, signal.SIGSTOP):\n    try:\n        os.kill(pid, sig)\n"
               "        print('SENT')\n    except OSError as e:\n        print('kill', e.errno)\n"
               "libc = ctypes.CDLL(None, use_errno=True)\n"
               "print('attach', libc.ptrace(16, pid, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH
               "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print('kill -1', e.errno)")
        res = pool.run(src, stdin=str(victim.pid))
        assert "SENT" not in res.stdout and res.stdout.count("attach -1") == 1, res
        assert victim.poll() is None  # alive
        with open(f"/proc/{victim.pid}/stat") as f:
            # neither stopped nor traced (T: stopped, t: tracing stop); S, R or a moment of D is fine
            assert f.read().split(") ")[1][0] not in "TtZX"
    finally:
        victim.kill()
        victim.wait()
    contained(pool)


def test_sibling_workers_cannot_be_killed(pool):
    before = pool.worker_pids()
    src = ("import json, os, signal, sys\nfor pid in json.loads(sys.stdin.read()):\n    try:\n"
           "        os.kill(pid, signal.SIGKILL)\n        print('SENT', pid)\n    except OSError as e:\n"
           "        print('kill', pid, e.errno)")
    if not (_layer(pool, "uid").active or _layer(pool, "filesystem").active):
        pytest.skip("neither a uid of its own nor a pid namespace")
    for _ in range(4):  # lands on each worker at least once with high probability, on one surely
        res = pool.run(src, stdin=json.dumps(before + [os.getpid()]))
        assert "SENT" not in res.stdout, res
    assert pool.worker_pids() == before and all(os.path.exists(f"/proc/{p}") for p in before)
    contained(pool)


def test_daemons_are_killed_when_the_program_ends(pool):
    src = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
           "        time.sleep(60)\n    os._exit(0)\nprint('parent done')")
    res = pool.run(src)
    assert res.exit_code == 0 and not res.timed_out and res.stdout == "parent done\n"
    assert leftovers(pool) == []
    contained(pool)


def test_sleeping_past_the_deadline_then_writing_does_nothing(pool, tmp_path):
    drop = tmp_path / "drop"
    drop.mkdir()
    drop.chmod(0o777)
    src = ("import os, sys, time\nd = sys.stdin.read()\nif os.fork() == 0:\n    os.setsid()\n"
           "    time.sleep(1.5)\n    print('LATE', flush=True)\n"
           "    try:\n        open(os.path.join(d, 'late.txt'), 'w').write('x')\n    except OSError:\n        pass\n"
           "    os._exit(0)\ntime.sleep(60)")
    res = pool.run(src, stdin=str(drop), timeout_s=0.5)
    assert res.timed_out and "LATE" not in res.stdout
    assert leftovers(pool) == []
    time.sleep(1.5)  # past the daemon's wake-up: had it survived, it would have written by now
    assert list(drop.iterdir()) == []
    contained(pool)


def test_non_utf8_output_is_replaced(pool):
    res = pool.run("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\n')\nsys.stderr.buffer.write(b'\\x80')")
    assert res.exit_code == 0 and res.stdout == "ok \ufffd\ufffd\n" and res.stderr == "\ufffd"
    contained(pool)


def test_output_flood_is_truncated_and_stopped(pool):
    res = pool.run("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)")
    assert res.truncated and res.killed_signal == signal.SIGKILL and not res.timed_out
    assert res.stdout == "x" * LIMITS.output_bytes
    contained(pool)


def test_worker_killed_while_idle_is_replaced_before_use(pool):
    victim = pool.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    while open(f"/proc/{victim}/stat").read().split(") ")[1][0] != "Z":  # dead, not yet reaped by the pool
        time.sleep(0.01)
    # Two programs at once: while one worker is busy with the first, the second must go to the other.
    futures = [pool.submit("import time; time.sleep(0.5); print(1)") for _ in range(2)]
    assert [f.result().stdout for f in futures] == ["1\n", "1\n"]
    assert victim not in pool.worker_pids() and len(pool.worker_pids()) == 2
    contained(pool)


def test_worker_dying_mid_run_fails_that_run_only(pool):
    future = pool.submit("import time; time.sleep(30)")
    for _ in range(200):  # until the program is running under one of the workers
        busy = [w for w in pool.worker_pids() if procs.descendants(w)]
        if busy:
            break
        time.sleep(0.05)
    os.kill(busy[0], signal.SIGKILL)
    with pytest.raises(SandboxError, match="replaced"):
        future.result(timeout=60)
    assert busy[0] not in pool.worker_pids()
    contained(pool)

