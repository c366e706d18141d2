"""A small MCP server (stdio) with calculator tools: ``python -m flowrl.envs.mcp_calc_server``.

Served by the ``mcp`` package's own server (``MCPServer``, stdio transport); the tools evaluate
with :func:`flowrl.envs.calculator.evaluate` (the syntax tree, no ``eval``). Used by the tests of
:mod:`flowrl.envs.mcp_tools` and by ``flows/mcp_calc.flow``.
"""

from __future__ import annotations

from mcp.server import MCPServer

from flowrl.envs.calculator import evaluate, show

server = MCPServer("flowrl-calculator")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."""
    return show(evaluate(expression))


if __name__ == "__main__":
    server.run("stdio")
