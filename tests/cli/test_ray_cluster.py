"""A Ray cluster as users start it: two `ray start` nodes on this machine (a head and a worker,
each with its own ports; Ray 2.60's token authentication on, as `ray start` sets it up), and a
two-node flow run against it through `RAY_ADDRESS`, the way `flowrl run` joins a cluster.

The nodes run `ray start --block` in their own process groups and are stopped by those ids
afterwards (never `ray stop`, which would stop every Ray on the machine). The nodes are CPU-only,
as `ray start` makes them here (no GPUs declared): a plan for the `cpu` platform takes one core per
logical GPU (`flowrl.runtime.placement.slot_resource`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from e2e_kit import make_workdir, write_flow  # noqa: E402

from flowrl.launch import RAY_AUTH_HELP, run_file  # noqa: E402
from flowrl.runtime.errors import user_error  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GRPO = "grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 6, lr = 3e-3, kl = 0.0, seed = 1)"
TWO_NODES = """
schedule main on cluster(nodes = 2, gpus_per_node = 1) {
  pool train = gpus(gpus = 1, nodes = 1)
  pool gen = gpus(gpus = 1, nodes = 1)
  place policy.rollout on gen
  place policy.train on train
}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(args: list[str], log: Path) -> subprocess.Popen:
    # Token authentication on every node, as Ray's docs set up a cluster (a worker joining an
    # explicit address does not look for the token unless told to).
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token"}
    ray_cli = str(Path(sys.executable).parent / "ray")
    with open(log, "w") as out:
        return subprocess.Popen([ray_cli, "start", "--block", "--disable-usage-stats", "--num-cpus=2",
                                 f"--dashboard-agent-listen-port={free_port()}", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_node(proc: subprocess.Popen) -> None:
    """SIGTERM to the node's process group (`ray start --block` stops its daemons), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def alive_nodes(address: str) -> int:
    """Alive nodes, asked from a separate driver process (this one must join through flowrl)."""
    code = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print(sum(n['Alive'] for n in ray.nodes()))")
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    proc = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=120, env=env)
    return int(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 and proc.stdout.strip() else 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if ray.is_initialized():
        ray.shutdown()
    work = make_workdir(tmp_path_factory.mktemp("ray_cluster"), rows=40, train=32)
    temp = Path(tempfile.mkdtemp(prefix="frl-ray-", dir="/tmp"))  # short: Ray's socket paths are length-limited
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = start_node(["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}",
                       f"--ray-client-server-port={free_port()}"], work / "head.log")
    nodes = [head]
    try:
        deadline = time.time() + 120
        while alive_nodes(address) < 1:
            assert head.poll() is None and time.time() < deadline, (work / "head.log").read_text()[-3000:]
            time.sleep(2)
        nodes.append(start_node([f"--address={address}"], work / "worker.log"))
        while alive_nodes(address) < 2:
            assert nodes[1].poll() is None and time.time() < deadline, (work / "worker.log").read_text()[-3000:]
            time.sleep(2)
        yield work, address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for proc in reversed(nodes):
            stop_node(proc)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_flow_runs_on_a_two_node_cluster_started_by_ray_start(cluster, monkeypatch):
    work, address = cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # found from the token, as Ray's CLI finds it
    path = write_flow(work / "two_nodes.flow", GRPO, 2, TWO_NODES)
    result = run_file(str(path), out=str(work / "run"))
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert [r["step"] for r in result.rows] == [1, 2] and result.rows[-1]["sync/bytes"] > 0
    rows = {r["engine"]: r for r in json.loads((result.out / "placement.json").read_text())}
    train, gen = rows["policy.train"], rows["policy.rollout"]
    assert train["node_id"] != gen["node_id"]  # two Ray nodes, as the plan's two nodes
    assert train["node_id"] == train["target_node_id"] and gen["node_id"] == gen["target_node_id"]


def test_joining_without_the_token_says_what_to_set(cluster, monkeypatch):
    work, address = cluster
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a client that does not send the cluster's token
    path = write_flow(work / "no_token.flow", GRPO, 1, TWO_NODES)
    with pytest.raises(Exception) as info:
        run_file(str(path), out=str(work / "no_token"), ray_address=address)
    message = user_error(info.value) or str(info.value)
    assert f"cannot join the Ray cluster at {address}" in message and RAY_AUTH_HELP in message, message
    assert not (work / "no_token").exists()  # a failed start leaves nothing behind
