"""Map failures a user can fix to one line; everything else is a bug and keeps its traceback."""

from __future__ import annotations

import sys


class RuntimeFlowError(RuntimeError):
    """A failure the user can act on, raised with the op's (or resource's) source position."""


class EngineFault(RuntimeFlowError):
    """An engine's process failed under the run (it hung, died, or went with its node): nothing in
    the flow is wrong, so restarting the engines from the last checkpoint may cure it, which
    ``flowrl run --restarts N`` does by itself.

    A subclass keeps its constructor's keyword arguments in ``fields`` (``op`` among them: the op
    whose engine call failed), so that :meth:`during` can rebuild it naming the op.
    """

    fields: dict

    def during(self, op) -> EngineFault:
        """The same failure naming ``op`` (an OpPlan: its id and source position); the pipeline knows the
        op, the engine calls do not."""
        if self.fields.get("op"):
            return self
        return type(self)(**{**self.fields, "op": f"`{op.id}` ({op.origin})"})


def _user_error_types() -> tuple[type, ...]:
    types: list[type] = [RuntimeFlowError]
    for mod, names in (("flowrl.engines.base", ("EngineError",)),
                       ("flowrl.data.datasets", ("DatasetError",)),
                       ("flowrl.data.sampler", ("SamplerStateError",)),
                       ("flowrl.models.warmstart", ("WarmStartError",)),
                       ("flowrl.models.tiny", ("TinyModelError",)),
                       ("flowrl.rewards.pool", ("RewardSpecError",)),
                       ("flowrl.rewards.verifiers", ("UnknownVerifierError",)),
                       ("flowrl.runtime.weight_sync", ("WeightSyncError",)),
                       ("flowrl.runtime.observe", ("ObserveError",))):
        module = sys.modules.get(mod)  # an error of a module never imported cannot have been raised: no import
        if module is None:             # here (flowrl.models' took 10 s of a refusal that needed none of it)
            continue
        types += [getattr(module, n) for n in names if hasattr(module, n)]
    return tuple(types)


def user_error(exc: BaseException) -> str | None:
    """The one-line message of a user-fixable failure (unwrapping Ray's task errors), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)  # Ray's RayTaskError: the actor's own exception
        if isinstance(cause, BaseException) and cause is not exc:
            exc = cause
            continue
        if isinstance(exc, _user_error_types()):
            return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, SystemExit) and isinstance(exc.code, str):
            return exc.code
        # Ray wraps an actor's exception: RayTaskError(.cause) / ActorDiedError(.cause or __cause__)
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return None
