"""The fork server the forked ranks of an engine start from (flowrl.engines.ranks.mp_context)."""

from __future__ import annotations

import torch

from flowrl.engines.ranks import server_preload


def test_the_fork_server_preloads_engine_modules_only_where_no_gpu_is_seen(monkeypatch):
    """A fork server that initialised CUDA leaves every forked rank unable to use it, and importing
    Megatron-core does (an H200 run: "Cannot re-initialize CUDA in forked subprocess"): with a GPU in
    sight the server imports only the ranks module, and each rank imports its engine after the fork."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert server_preload(("megatron.core.models.gpt",)) == ["flowrl.engines.ranks", "megatron.core.models.gpt"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert server_preload(("megatron.core.models.gpt",)) == ["flowrl.engines.ranks"]


def test_the_rank_context_preloads_what_server_preload_says(monkeypatch):
    """mp_context hands the fork server :func:`server_preload`'s list (not the engine's own)."""
    import multiprocessing.forkserver as forkserver

    import torch.multiprocessing as mp

    from flowrl.engines import ranks

    asked = []

    class Context:
        def set_forkserver_preload(self, modules):
            asked.append(list(modules))

    monkeypatch.setattr(mp, "get_context", lambda method: Context())
    monkeypatch.setattr(forkserver, "ensure_running", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ranks.mp_context(("megatron.core.models.gpt",))
    assert asked == [["flowrl.engines.ranks"]]
