"""Check that environments meet the ops that run them, and that agent programs can be called.

Requires: check_edge_types (every op's arguments have their catalogue types).

Guarantees:

* every op taking an environment runs it through the protocol it speaks (the catalogue's
  ``OpSpec.protocol``): ``env_step`` steps environments that answer model turns (``python_env``,
  the libraries' adapters); ``agent_rollout`` runs environments that drive the policy themselves
  through the rollout endpoint (``agent(...)``). A mismatch is E650, naming the op to use;
* an ``agent("module:function")`` names a function that takes ``(client, row)``: two positional
  arguments (E651, with the ``def`` line), read from the module's source without running it. A
  name the module binds otherwise (an import, an assignment) is left to the run. Whether the
  module and the name exist is ``check_resources``' (E605, E606).

The graph is returned unchanged.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... model m = tiny()
... env a = agent("flowrl.envs.calculator:evaluate")
... reward v = verifier("exact")
... flow f(d: dataset) {
...   c = generate(m, sample(d, size = 4), n = 2)
...   o = env_step(a, c)
... }''', "doc.flow", until="check_agents", allow_missing=True)
... except FlowError as e:
...     print(str(e).splitlines()[0])
doc.flow:7:16: error[E650]: `env_step` hands model turns to an environment, but `a` (agent) drives the policy itself through the rollout endpoint
"""

from __future__ import annotations

from flowrl.catalog.ops import OPS, OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.resources import folder_of
from flowrl.diagnostics import Collector
from flowrl.ir.graph import Const, FlowGraph, Node, Ref
from flowrl.pyrefs import RefError, find_module, function_params, split_ref

_SPEAKS = {None: "hands model turns to an environment", "openai": "runs environments that drive the policy "
                                                                   "through the rollout endpoint"}
"""How each protocol's op treats its environment, in words."""
_NEEDS = {None: "answers model turns (the env_step protocol)", "openai": "drives the policy itself through the "
                                                                       "rollout endpoint"}
"""What each protocol's environment does, in words."""


def _ops_speaking(protocol: str | None) -> list[str]:
    return sorted(name for name, s in OPS.items() if s.kind != OpKind.ENV and s.protocol == protocol
                  and any(a.type == "env" for a in s.args))


def check_agents(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    for node in graph.nodes():
        spec = OPS.get(node.op)
        if spec is None or spec.kind == OpKind.ENV:
            continue
        for i, arg in enumerate(spec.args):
            if arg.type != "env" or i >= len(node.args) or not isinstance(node.args[i], Ref):
                continue
            target = node.args[i].target
            env = graph.node(target) if target in graph else None
            env_spec = OPS.get(env.op) if env is not None else None
            if env_spec is None or env_spec.kind != OpKind.ENV or env_spec.protocol == spec.protocol:
                continue
            use = _ops_speaking(env_spec.protocol)
            errors.error("E650", f"`{node.op}` {_SPEAKS[spec.protocol]}, but `{target}` ({env.op}) "
                                 f"{_NEEDS[env_spec.protocol]}", node.args[i].span or node.span,
                         f"run `{target}` with {' or '.join(f'`{u}`' for u in use)}" +
                         (" (stdlib.agents)" if env_spec.protocol == "openai" else " (stdlib.agentic)"))
    for node in graph.nodes():
        spec = OPS.get(node.op)
        if spec is not None and spec.kind == OpKind.ENV and spec.protocol == "openai" and spec.python_ref == "function":
            _check_program(node, errors)
    errors.raise_if_any()
    return graph


def _check_program(node: Node, errors: Collector) -> None:
    """The agent program takes ``(client, row)`` (E651)."""
    if not node.args or not isinstance(node.args[0], Const) or not isinstance(node.args[0].value, str):
        return
    try:
        module, attr = split_ref(node.args[0].value)
    except RefError:
        return  # check_resources' E604
    found = find_module(module, folder_of(node))
    if found is None or found.source is None or "." in attr:
        return
    try:
        params = function_params(found.source, attr)
    except (SyntaxError, OSError, UnicodeDecodeError):
        return  # check_resources' E605
    if params is None or params.takes(2):
        return
    errors.error("E651", f"`{attr}` ({module}, line {params.line}) takes {params.required} required positional "
                         f"argument{'s' if params.required != 1 else ''} (at most {params.total}); an agent program "
                         "is called as run(client, row)", node.args[0].span or node.span,
                 f"define it as `async def {attr}(client, row):` (client: an openai.AsyncOpenAI pointed at the "
                 "rollout endpoint; row: the dataset row)")


__all__ = ["check_agents"]
