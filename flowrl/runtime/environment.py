"""One environment policy for every process a run starts, and Ray in a session of its own.

The driver (the ``flowrl`` process) keeps the user's environment: it reads the trackers' credentials
(``WANDB_API_KEY`` or ``wandb login``'s netrc entry, ``MLFLOW_TRACKING_TOKEN``/``_PASSWORD``) and the
Hub's token (``HF_TOKEN``) itself: the trackers run in the driver, and no Ray process needs them. Every process it starts gets a
*scrubbed* environment instead (:func:`scrubbed`): only the variables a run needs to work, by name
(:data:`BASE_NAMES`, :data:`BASE_PREFIXES`: ``PATH``, ``HOME``, the locale, the Python, CUDA, Ray,
thread, cache and library settings, and flowrl's own ``FLOWRL_*``), never one whose name says it is
a secret (:func:`~flowrl.runtime.secrets.is_secret_name`), plus the secrets named for that kind
of process in :data:`GIVEN`, the one table of who gets which secret:

* ``ray``: Ray's own processes (``gcs_server``, ``raylet``, its agents and log monitor), and through
  the raylet every Ray worker: the engines' actors, their rank processes, vLLM's and SGLang's
  engine subprocesses, the fork servers, the environment pools. They get ``RAY_AUTH_TOKEN`` (Ray's
  own credential: every Ray process needs it to join the session) and the variables the user names
  in ``FLOWRL_PASS_ENV`` (comma-separated: e.g. ``HF_TOKEN`` for an engine that downloads itself).
* ``reward``: a ``python_reward``'s worker processes: the variables named in ``FLOWRL_PASS_ENV``.
* ``tracker``: a tracker's helper process (W&B's service): no secret, and the proxy settings it needs to
  reach a server (``HTTPS_PROXY``...: they may hold a proxy's password, so only this process gets them).
  Online, the W&B key reaches the service with the run's settings over its socket (``wandb.init``'s
  ``api_key``), never in its environment. MLflow runs inside the driver (no process of its own).
* ``tool``: helper processes (Graphviz's ``dot``, the automatic CPU benchmark, ``flowrl profile``'s
  workers): no secret.
* the code sandbox's workers build their own, smaller environment (:mod:`flowrl.sandbox`).

Nothing secret goes through a ``runtime_env`` (Ray stores it in the GCS, where any driver of the
cluster reads it). A cluster the user joins (``--ray ADDRESS``, ``RAY_ADDRESS``) is not flowrl's:
its processes have the environment they were started with, which flowrl cannot scrub; the run's
actors there get the scrubbed variables of :data:`ACTOR_ENV` through their ``runtime_env``, never
a secret, and ``FLOWRL_PASS_ENV`` is not passed there.

A local Ray instance of the run's own is started by :func:`local_ray_processes`: its processes get
the ``ray`` environment and start in a **new session** (``setsid``), so a signal to flowrl's process
group (Ctrl-C in a terminal, ``timeout``, Slurm, Kubernetes, ``kill -- -PGID``) reaches flowrl
alone; flowrl then stops them itself, by process id (:func:`stop_processes`; never ``ray stop``,
which would stop every Ray instance of the user's on the machine). They also die with flowrl if it
is killed (Ray's kernel fate-sharing: ``PR_SET_PDEATHSIG``).

>>> env = {"PATH": "/bin", "HF_TOKEN": "hf_abcdefghij", "HF_HOME": "/h", "MY_DB_URL": "x", "FLOWRL_CACHE": "/c"}
>>> sorted(scrubbed(env))
['FLOWRL_CACHE', 'HF_HOME', 'PATH']
>>> sorted(process_env("ray", {**env, "FLOWRL_PASS_ENV": "HF_TOKEN"}))
['FLOWRL_CACHE', 'FLOWRL_PASS_ENV', 'HF_HOME', 'HF_TOKEN', 'PATH']
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Mapping

from flowrl.runtime.secrets import is_secret_name

BASE_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "TMP", "TEMP", "SHELL",
    "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "PYTHONHASHSEED",
    "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "LD_LIBRARY_PATH", "LD_PRELOAD", "MALLOC_CONF",
    "XDG_CACHE_HOME", "XDG_RUNTIME_DIR", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    "TQDM_DISABLE", "CC", "CXX",
})
"""Variables every process flowrl starts keeps (when set), by exact name."""

BASE_PREFIXES = ("LC_", "FLOWRL_", "RAY_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "TORCH_", "TORCHINDUCTOR_",
                 "PYTORCH_", "TRITON_", "VLLM_", "SGLANG_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "HIP_",
                 "ROCR_", "ROCM_", "KMP_", "MKL_", "OMP_", "GOMP_", "OPENBLAS_", "JEMALLOC_", "WANDB_")
"""Variables every process flowrl starts keeps (when set), by prefix: the settings of Ray, CUDA, the
engines, the Hub's caches and the thread pools. A name that says it is a secret (``HF_TOKEN``,
``RAY_AUTH_TOKEN``) is dropped all the same, unless :data:`GIVEN` names it."""

PASS_ENV = "FLOWRL_PASS_ENV"
"""Comma-separated names of variables (secrets included) the user asks the run to pass on: to Ray's
processes of a local instance and to reward workers, never through a ``runtime_env``."""

GIVEN: dict[str, tuple[str, ...]] = {
    "ray": ("RAY_AUTH_TOKEN",),
    "reward": (),
    "tracker": ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "https_proxy", "http_proxy", "no_proxy"),
    "tool": (),
}
"""The one table of which kind of process gets which secret (besides :data:`PASS_ENV`'s names)."""

ACTOR_ENV = ("FLOWRL_THREADS", "FLOWRL_CACHE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY",
             "TQDM_DISABLE", "VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM")
"""Variables a run passes to its Ray actors in their ``runtime_env`` (what reaches them on a cluster the
user started, whose processes do not have the driver's environment); none is a secret."""


def keeps(name: str) -> bool:
    """Whether a process flowrl starts keeps variable ``name`` (before :data:`GIVEN`)."""
    return (name in BASE_NAMES or name.startswith(BASE_PREFIXES)) and not is_secret_name(name)


def passed_names(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The names the user listed in :data:`PASS_ENV`."""
    env = os.environ if environ is None else environ
    return tuple(n.strip() for n in env.get(PASS_ENV, "").split(",") if n.strip())


def scrubbed(environ: Mapping[str, str] | None = None, *, given: Iterable[str] = ()) -> dict[str, str]:
    """``environ`` (default: this process's) with only what :func:`keeps` keeps, plus the variables ``given``."""
    env = os.environ if environ is None else environ
    given = set(given)
    return {k: v for k, v in env.items() if keeps(k) or k in given}


def process_env(who: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process of kind ``who`` (a key of :data:`GIVEN`): :func:`scrubbed`, plus
    its secrets in :data:`GIVEN` and the user's :data:`PASS_ENV` names."""
    return scrubbed(environ, given=(*GIVEN[who], *passed_names(environ)))


# ---- Ray's own processes ---------------------------------------------------------------------

_patch_lock = threading.Lock()


@contextlib.contextmanager
def local_ray_processes() -> Iterator[None]:
    """Around ``ray.init`` of a local instance: every process Ray starts meanwhile (``gcs_server``,
    ``raylet``, the agents, the log monitor) gets :func:`process_env` ``("ray")`` computed from the
    environment Ray gives it (this process's, plus Ray's own ``RAY_*`` settings) and starts in a new
    session. Ray starts them through ``ray._private.services.ConsolePopen`` (Ray 2.60); its workers are
    the raylet's children and inherit the raylet's environment and session."""
    from ray._private import services

    base = services.ConsolePopen

    class ScrubbedPopen(base):
        def __init__(self, *args, **kwargs):
            env = kwargs.get("env")
            kwargs["env"] = process_env("ray", os.environ if env is None else env)
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    with _patch_lock, _ray_defaults():
        services.ConsolePopen = ScrubbedPopen
        try:
            yield
        finally:
            services.ConsolePopen = base


RAY_DEFAULTS = {"RAY_worker_niceness": "0"}
"""Ray settings a local instance of the run's own starts with, unless the user set them. Ray lowers its
workers' priority (nice 15) by default: on a machine where anything else runs at normal priority, every
engine then gets a few percent of a core (measured: two busy loops left a run's actors ~4% of a core
each, and its vLLM engine took 13 minutes to start)."""


@contextlib.contextmanager
def _ray_defaults() -> Iterator[None]:
    """:data:`RAY_DEFAULTS` in this process's environment while Ray starts (its processes read them)."""
    added = [k for k in RAY_DEFAULTS if k not in os.environ]
    os.environ.update({k: RAY_DEFAULTS[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def local_ray_pids() -> list[int]:
    """Process ids of the processes the local Ray instance this process started runs (empty when it
    joined a cluster, or Ray is not started)."""
    try:
        import ray

        node = ray._private.worker._global_node
    except (ImportError, AttributeError):
        return []
    if node is None:
        return []
    return [info.process.pid for infos in node.all_processes.values() for info in infos
            if getattr(info, "process", None) is not None]


def stop_processes(pids: Iterable[int], grace_s: float = 5.0) -> None:
    """SIGTERM each of ``pids`` still running, then SIGKILL what is left after ``grace_s``. By process id
    only: nothing else on the machine is touched. Nothing is reaped here (their ``Popen`` objects, Ray's,
    do that)."""
    live = [p for p in pids if _running(p)]
    for pid in live:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = [p for p in live if _running(p)]
    for pid in live:
        _signal(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


# ---- processes started from the driver with Python's multiprocessing ------------------------

_environ_lock = threading.Lock()


@contextlib.contextmanager
def environ_for(who: str) -> Iterator[None]:
    """While inside, this process's ``os.environ`` is :func:`process_env` ``(who)``: for processes started
    by libraries that take no ``env`` (``multiprocessing``'s "spawn" and its resource tracker). Used only
    around such a start (milliseconds); restored on exit. Other threads see the scrubbed environment
    meanwhile, never a larger one."""
    with _environ_lock:
        saved = dict(os.environ)
        wanted = process_env(who, saved)
        try:
            for name in [n for n in os.environ if n not in wanted]:
                del os.environ[name]
            yield
        finally:
            os.environ.update(saved)


__all__ = ["BASE_NAMES", "BASE_PREFIXES", "PASS_ENV", "GIVEN", "ACTOR_ENV", "RAY_DEFAULTS", "keeps", "passed_names", "scrubbed",
           "process_env", "local_ray_processes", "local_ray_pids", "stop_processes", "environ_for"]
