"""TextArena games through the environment protocol: ``env g = textarena("GuessTheNumber-v0")``.

The adapter (:class:`TextArenaGame`, named by the ``textarena`` record of
:data:`flowrl.catalog.env_libraries.ENV_LIBRARIES`) makes the game with ``textarena.make(id)``
for each episode and plays the model as player 0:

* ``reset(row)``: ``env.reset(num_players = players, seed = row["seed"])``. The episode's first
  prompt is the game's first observation for that seed: the dataset's rows are made by
  :func:`make_rows` (``python -m flowrl.envs.textarena_games GAME N SEED > rows.jsonl``), one
  game per row with its ``seed``, so the conversation the model starts from is the game's own;
* ``step(turn)``: ``env.step(turn)`` (the model's whole turn is its action; TextArena's wrappers
  find the move in it, e.g. ``[7]``); then, in a game for more players, each other player's move
  comes from ``opponent`` (a function ``"module:function"`` taking that player's observation and
  returning its action) until it is player 0's turn again. The observation is what the game
  added to player 0's observation since the model last saw it (without the echo of its own
  move); it is also given as one user message, rendered by the chat template of a chat model.
* the episode ends when the game does: the reward is player 0's (``env.close()``'s rewards: 1 a
  win, 0 a draw, -1 a loss in TextArena's convention); an invalid move counts as a
  ``tool_error``.

Some of TextArena's games use Python 3.12 syntax and do not import on Python 3.11: ``flowrl
check`` reads the game's module and refuses those (E642) before anything runs.
"""

from __future__ import annotations

import json
import sys

from flowrl.envs import StepResult


def _text(obs) -> str:
    """A TextArena observation as text (a string, or a list of (sender, message[, kind]) entries)."""
    if isinstance(obs, str):
        return obs
    if isinstance(obs, (list, tuple)):
        return "\n".join(str(o[1]) if isinstance(o, (list, tuple)) and len(o) >= 2 else str(o) for o in obs)
    return str(obs)


def _call(ref: str):
    from flowrl.pyrefs import import_module_from, split_ref

    module, attr = split_ref(ref)
    return getattr(import_module_from(module, None), attr)


def _make(game: str, players: int, seed: int):
    import textarena

    env = textarena.make(game)
    env.reset(num_players=players, seed=seed)
    return env


class TextArenaGame:
    """One TextArena game per episode, the model as player 0 (see the module docstring)."""

    def __init__(self, options: dict):
        self.game = str(options["target"])
        self.players = int(options.get("players") or 1)
        ref = options.get("opponent")
        self.opponent = _call(str(ref)) if ref else None
        if self.players > 1 and self.opponent is None:
            raise ValueError(f"`{self.game}` with players = {self.players}: the other players' moves need an "
                             "`opponent = \"module:function\"` (observation -> action)")

    def reset(self, row: dict) -> None:
        self.env = _make(self.game, self.players, int(row.get("seed", 0)))
        self._others()
        self.seen = _text(self.env.get_observation()[1])

    def _others(self) -> tuple[bool, dict]:
        """The other players move until it is player 0's turn or the game is over."""
        done, info = False, {}
        while not done and self.env.state.current_player_id != 0:
            pid, obs = self.env.get_observation()
            done, info = self.env.step(str(self.opponent(_text(obs))))
        return done, info

    def step(self, turn: str) -> StepResult:
        done, info = self.env.step(turn)
        if not done:
            done, info = self._others()
        invalid = bool(self.env.state.game_info.get(0, {}).get("invalid_move")) if hasattr(self.env, "state") else False
        if done:
            rewards, _ = self.env.close()
            reward = float((rewards or {}).get(0) or 0.0)
            return StepResult("", reward, True, {"tool_call": False, "tool_error": invalid})
        obs = _text(self.env.get_observation()[1])
        new = obs[len(self.seen):] if obs.startswith(self.seen) else obs
        self.seen = obs
        lines = new.lstrip("\n").split("\n")
        if lines and lines[0].startswith("[Player]"):  # the game echoes the model's move: it is in the row already
            lines = lines[1:]
        text = "\n".join(lines).strip("\n")
        return StepResult("\n" + text + "\n", 0.0, False, {"tool_call": False, "tool_error": invalid},
                          messages=({"role": "user", "content": text},))

    def close(self) -> None:
        self.env = None


def make_rows(game: str, n: int, seed: int, players: int = 1) -> list[dict]:
    """``n`` games of ``game`` (seeds ``seed``, ``seed + 1``, ...): each row's ``prompt`` is player 0's
    first observation, ``seed`` the game's seed (``answer`` is empty: the game itself scores)."""
    rows = []
    for s in range(seed, seed + n):
        env = _make(game, players, s)
        rows.append({"prompt": _text(env.get_observation()[1]), "answer": "", "seed": s})
    return rows


if __name__ == "__main__":  # python -m flowrl.envs.textarena_games GAME N SEED [PLAYERS] > rows.jsonl
    args = sys.argv[1:]
    if len(args) not in (3, 4):
        sys.exit("usage: python -m flowrl.envs.textarena_games GAME N SEED [PLAYERS] > rows.jsonl")
    for r in make_rows(args[0], int(args[1]), int(args[2]), int(args[3]) if len(args) == 4 else 1):
        print(json.dumps(r))
