"""Predict a run and calibrate the ``cpu`` profile: the simulator against measured runs, through the compiler.

:mod:`flowrl.cost.validate` reads a run directory and summarises what it measured; here a
flow is compiled as the compiler plans it (:func:`compile_spec`), the measured workload is
put into its simulation (:func:`predict`), and the figures of the ``cpu`` profile a matmul
and a memcpy cannot show are solved from the runs' engine spans (:func:`calibrate`). Pure
Python: the compiler and the cost model, no torch or Ray (``flowrl profile --calibrate``,
``bench/sim_validation.py``).

>>> CALIBRATION_ROUNDS
4
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from flowrl.catalog.ops import OpKind
from flowrl.compiler.pipeline import compile_file
from flowrl.compiler.schedule.estimate import build_sim
from flowrl.compiler.workload import workload
from flowrl.cost.profiles import Profile, save_profile
from flowrl.cost.sim import PhaseKind, simulate, with_workload
from flowrl.cost.validate import ValidateError, _median, generate_iterations, line, nnls3


def compile_spec(flow_file: str, sets: dict | None = None, flow: str | None = None, profile: Profile | None = None):
    """``(graph, SimSpec, costs)`` of a flow as the compiler plans it, under ``profile`` for
    ``gpu = "cpu"`` (default: the current ``cpu`` profile, ``$FLOWRL_PROFILE``); ``costs`` rows
    are ``(phase id, kind, engine or driver/reward, seconds, tokens)``."""
    with _profile_in_effect(profile):
        graph = compile_file(flow_file, flow,
                             options={"overrides": {k: str(v) for k, v in (sets or {}).items()}}).graph
        spec, costs, _, _ = build_sim(graph, graph.sched, workload(graph))
    return graph, spec, costs


@contextmanager
def _profile_in_effect(profile: Profile | None):
    """Make ``profile`` the ``cpu`` profile the compiler reads (a temp file via ``$FLOWRL_PROFILE``)."""
    if profile is None:
        yield
        return
    old = os.environ.get("FLOWRL_PROFILE")
    with tempfile.TemporaryDirectory(prefix="flowrl-cal-") as d:
        os.environ["FLOWRL_PROFILE"] = str(save_profile(profile, Path(d) / "profile.json"))
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("FLOWRL_PROFILE", None)
            else:
                os.environ["FLOWRL_PROFILE"] = old


def predict(flow_file: str, sets: dict | None = None, workload: dict | None = None, *, flow: str | None = None,
            steps: int = 12, seed: int = 0):
    """Simulate a flow's plan on a measured ``workload`` (:func:`measure_run`'s, plus an optional
    ``prompt_tokens``); returns the :class:`~flowrl.cost.sim.SimResult`."""
    _, spec, _ = compile_spec(flow_file, sets, flow)
    w = workload or {}
    spec = with_workload(spec, prompt_tokens=w.get("prompt_tokens"), mean_response=w.get("mean_response"),
                         seconds=w.get("seconds"))
    return simulate(spec, steps=steps, seed=seed)


def calibrate(profile: Profile, runs: list[tuple[str, dict]], sets: dict | None = None) -> Profile:
    """``profile`` with what a matmul and a memcpy cannot show, measured from runs on this machine.

    ``runs`` are ``(flow file, measure_run(...))`` pairs (a run's ``"sets"``, if any, are the
    parameter overrides it ran with; else ``sets``). Each figure comes from the phases
    that show it, in the runs' own traces and workloads:

    * ``op_overhead_s``: the median dispatch overhead (driver span minus engine span);
    * decode: a generate's engine seconds are ``a x iteration + s x per sequence + n x per
      request + b x prefill`` (:func:`generate_iterations`); less the cost model's own part
      (weights + KV reads, FLOPs), the rest is ``iter_overhead_s``, ``seq_overhead_s`` and
      ``request_overhead_s``, solved by non-negative least squares over the runs (runs whose
      responses differ in length separate per-sequence from per-request costs; when they
      cannot tell two apart, the per-iteration and per-sequence costs are kept);
    * update: engine seconds = ``micro-batches x micro_overhead_s + FLOP time / mfu_train``:
      both from runs whose shapes differ, else ``mfu_train`` alone;
    * ``mfu_forward``: the achieved fraction of the matmul peak in log-prob / value passes.

    Tokens are each run's samples x (prompt + mean response). The generate's modelled part
    depends on ``mfu_forward``, so the figures are solved together over
    :data:`CALIBRATION_ROUNDS` rounds, each compiling the flows under the last round's
    profile. Raises :class:`ValidateError` when the runs show no engine span.
    """
    if not any(m.get("engine") for _, m in runs):
        raise ValidateError("the runs' traces have no engine spans (forward:, train:, generate[); "
                            "hint: calibrate from run directories written by `flowrl run`")
    current = profile
    for _ in range(CALIBRATION_ROUNDS):
        current = _calibrate_once(current, runs, sets)
    parts = [f"dispatch {current.op_overhead_s * 1e3:.1f} ms/op",
             f"decode {current.iter_overhead_s * 1e3:.1f} ms + {current.seq_overhead_s * 1e6:.0f} us/sequence "
             f"per iteration + {current.request_overhead_s * 1e6:.0f} us/request",
             f"{current.micro_overhead_s * 1e3:.1f} ms/micro-batch",
             f"mfu forward {current.mfu_forward:.2f} / train {current.mfu_train:.2f}"]
    names = ", ".join(Path(f).name for f, _ in runs)
    note = f"; calibrated from runs of {names} ({', '.join(parts)})"
    return replace(current, source=profile.source.split("; calibrated from run")[0] + note)


CALIBRATION_ROUNDS = 4
"""Rounds of :func:`calibrate` (each one's error is a small fraction of the last one's)."""


def _calibrate_once(profile: Profile, runs: list[tuple[str, dict]], sets) -> Profile:
    dispatch, decode, update, forward = [], [], [], []  # observations of each kind over the runs
    for flow_file, measured in runs:
        obs = _observations(profile, flow_file, measured, measured.get("sets", sets))
        dispatch.append(measured.get("dispatch_s", profile.op_overhead_s))
        decode += obs["decode"]
        update += obs["train"]
        forward += obs["forward"]
    changes: dict = {"op_overhead_s": _median(dispatch)}
    if decode:  # y = iter_overhead x a + seq_overhead x s + request_overhead x n
        changes.update(zip(("iter_overhead_s", "seq_overhead_s", "request_overhead_s"), nnls3(decode)))
    if update:  # engine = n_micro x micro_overhead + w / mfu
        # e / w = 1 / mfu + micro_overhead x (n / w): a line in n / w
        inv, c = line([(n / w, e / w) for n, w, e in update], through_origin_if_degenerate=False)
        if inv is None or inv <= 0:  # one shape only: the micro-batch overhead stays as it is
            c = profile.micro_overhead_s
            inv = _median((e - n * c) / w for n, w, e in update)
        changes.update(micro_overhead_s=c, mfu_train=1.0 / max(inv, 1e-9))
    if forward:
        changes["mfu_forward"] = _median(forward)
    return replace(profile, **changes)


def _observations(profile: Profile, flow_file: str, measured: dict, sets) -> dict:
    """What one run says, as the linear relations :func:`_calibrate_once` solves."""
    _, spec, _ = compile_spec(flow_file, sets, profile=profile)
    # n_micro x epochs of each update, exactly as the cost model counts them: the phase's fixed
    # seconds grow by 1 s per micro-batch when the per-micro-batch cost is 1 s
    _, probe, _ = compile_spec(flow_file, sets, profile=replace(profile, micro_overhead_s=profile.micro_overhead_s + 1))
    n_micro = {p.id: q.seconds - p.seconds for p, q in zip(spec.phases, probe.phases)}
    w = measured.get("workload", {})
    engine = measured.get("engine", {})
    iters = generate_iterations(spec, w)
    gens = {ph.id: ph.gen for ph in spec.phases if ph.kind == PhaseKind.GENERATE}
    out: dict = {"decode": [], "train": [], "forward": []}
    for ph in spec.phases:
        if ph.id not in engine:
            continue
        if ph.kind == PhaseKind.GENERATE and ph.id in iters and iters[ph.id][0] > 0:
            a, s_, n, b = iters[ph.id]
            g = ph.gen
            core = (a * (g.iter_s - profile.iter_overhead_s) + s_ * (g.seq_s - profile.seq_overhead_s)
                    + n * (g.request_s - profile.request_overhead_s) + b * g.prefill_s)
            out["decode"].append(((a, s_, n), max(engine[ph.id] - core, 0.0)))
        elif ph.kind == PhaseKind.WORK and ph.per_token_s > 0 and ph.tokens_from in gens:
            g = gens[ph.tokens_from]
            tokens = g.samples * (float(w.get("prompt_tokens") or g.prompt_tokens)
                                  + float(w.get("mean_response") or g.lengths.mean()))
            if ph.label == OpKind.UPDATE.value:
                # FLOP seconds at mfu 1: the modelled seconds per token scale as 1 / mfu
                out["train"].append((max(round(n_micro.get(ph.id, 1.0)), 1),
                                      ph.per_token_s * profile.mfu_train * tokens, engine[ph.id]))
            else:
                out["forward"].append(profile.mfu_forward * ph.per_token_s * tokens / max(engine[ph.id], 1e-9))
    return out


__all__ = ["compile_spec", "predict", "calibrate", "CALIBRATION_ROUNDS"]
