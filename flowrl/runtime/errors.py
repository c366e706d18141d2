"""Map failures a user can fix to one line; everything else is a bug and keeps its traceback."""

from __future__ import annotations

import re
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


class ModelLoadError(RuntimeFlowError):
    """An engine could not load its model at start-up (the files passed ``flowrl check``'s reading of them as
    data, and still the engine's loader refused them: tensors of the wrong shape, a config its code rejects):
    the model, its directory, the engine and the loader's own reason, in one line."""

    def __init__(self, origin: str, model: str, who: str, path: str, cause: BaseException):
        self.cause_text = innermost(cause)
        super().__init__(
            f"{origin}: model `{model}` could not be loaded from {path} by its engine {who}: {self.cause_text}; "
            "hint: the directory must hold a whole transformers checkpoint whose config.json describes its weights "
            "(write it with `save_pretrained(dir)`)")


_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Fault)): (.+)$")
"""The last line of a Python traceback: ``RuntimeError: what went wrong``."""


def innermost(error: BaseException) -> str:
    """The exception at the bottom of Ray's wrapping, as ``Type: first line``: ``RayTaskError.cause``,
    ``__cause__``; an actor whose constructor raised (``ActorDiedError``) keeps only the text of the remote
    traceback, whose last ``Type: message`` line is read.

    >>> innermost(RuntimeError("The actor died because of an error raised in its creation task\\n"
    ...                        "Traceback (most recent call last):\\n  File x\\nOSError: no file named model.safetensors"))
    'OSError: no file named model.safetensors'
    """
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "cause", None)
        inner = inner if isinstance(inner, BaseException) else error.__cause__
        if inner is None:
            break
        error = inner
    lines = [line.rstrip() for line in str(error).splitlines()]
    raised = [m for m in map(_RAISED.match, lines) if m]
    if raised:
        return f"{raised[-1].group(1).rsplit('.', 1)[-1]}: {raised[-1].group(2)}"
    first = next((line.strip() for line in lines if line.strip()), "")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


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
                       ("flowrl.runtime.observe", ("ObserveError",)),
                       ("flowrl.runtime.rundir", ("RunDirError",))):
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
