"""Environment libraries flowrl adapts: one record per library (its package, its adapter, its registry).

An environment declared with a library's op (``textarena("GuessTheNumber-v0")``,
``gymnasium("my_envs:Guess-v0")``, ``openenv("my_env:MyEnv", action = "my_env:MyAction")``,
``mcp("python -m my_server")``, ``verifiers("my_taskset")``) runs through the ``env_step`` protocol (:mod:`flowrl.envs`): the
runtime hosts the record's ``adapter`` class (in :mod:`flowrl.envs`) in the environment pool, built
with the declaration's options, and the adapter drives the library's own objects.

The compiler reads these records without importing any library
(:mod:`flowrl.compiler.passes.check_env_libraries`): the package is installed (``module`` found by
``importlib.util.find_spec``; missing: E640 with ``pip``), the environment id exists in the
library's registry, read from the registry's source (``registry``: see :data:`REGISTRIES`; unknown:
E641 with the nearest ids), and the module that defines it compiles on this Python (E642).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvLibrary:
    """How flowrl uses one environment library."""

    op: str
    """The catalogue op that declares such an environment (``textarena(...)``)."""
    module: str
    """The top-level module the library installs (what ``import`` names)."""
    pip: str
    """What to install when it is missing (the version flowrl is tested with)."""
    adapter: str
    """``module:Class`` of the flowrl adapter: built with the declaration's options, it speaks
    :mod:`flowrl.envs`' protocol and drives the library."""
    registry: str | None = None
    """How the environment named in the first argument is looked up at check time: a key of
    :data:`REGISTRIES`, or None (the first argument is a ``module:Class`` reference or a command)."""
    check: str = ""
    """What ``flowrl check`` reads for it beyond the package (a check of
    :mod:`flowrl.compiler.passes.check_env_libraries`): ``game_ids`` / ``env_ids`` (the id in the
    registry, its module compiling), ``action_class`` (an OpenEnv action class), ``server_command``
    (an MCP server's module or program), ``taskset_module`` (a verifiers taskset's module)."""
    tools: bool = False
    """The environment offers tools to the model (their JSON schemas rendered by the chat
    template, the model's calls parsed in its format): the prompts it continues must be chat
    prompts (``chat = true``)."""


REGISTRIES = {
    "textarena": "register calls in textarena/envs/__init__.py (`register(id=...)`, "
                 "`register_with_versions(id=..., wrappers={...})` with its `-raw` variant)",
    "gymnasium": "`register(id=...)` calls in gymnasium/envs/__init__.py, or in the module named before "
                 "`:` (`module:EnvId`, gymnasium's own syntax: the module registers its environments)",
}
"""Registry kind -> where its environment ids are read from (by :mod:`ast`, never imported)."""


ENV_LIBRARIES: dict[str, EnvLibrary] = {lib.op: lib for lib in (
    EnvLibrary("textarena", "textarena", "textarena==0.7.4", "flowrl.envs.textarena_games:TextArenaGame",
               registry="textarena", check="game_ids"),
    EnvLibrary("gymnasium", "gymnasium", "gymnasium==1.4.0", "flowrl.envs.gymnasium_envs:GymnasiumText",
               registry="gymnasium", check="env_ids"),
    EnvLibrary("openenv", "openenv", "openenv-core==0.3.0", "flowrl.envs.openenv_envs:OpenEnvInProcess",
               check="action_class"),
    EnvLibrary("verifiers", "verifiers", "verifiers==0.4.0", "flowrl.envs.verifiers_tasks:VerifiersTasks",
               check="taskset_module"),
    EnvLibrary("mcp", "mcp", "mcp==2.0.0", "flowrl.envs.mcp_tools:MCPTools", check="server_command",
               tools=True),
)}
"""Op name -> its library's record."""


__all__ = ["EnvLibrary", "ENV_LIBRARIES", "REGISTRIES"]
