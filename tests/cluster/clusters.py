"""Helpers for the cluster tests: one simulated cluster per module, a reference system."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import anyio

from actord.vocabulary.config import ClusterConfig, Config

NO_RAY = "ray is not installed: the cluster is the optional extra actord[ray] (CI installs it via the dev extra)"


def node_config(model: str, **kw: Any) -> Config:
    return Config(model=model, **{"slots": 2, "ctx": 1024, "batch": 64, "threads": 1, **kw})


@contextlib.contextmanager
def local_cluster(root: Path, model: str, *, nodes: int = 3, cluster: dict[str, Any] | None = None,
                  node: dict[str, Any] | None = None, **kw: Any) -> Iterator[Any]:
    from actord.cluster.local import LocalCluster

    # Each simulated node has a made-up GPU and its daemon holds it (num_gpus=1, num_cpus=0),
    # as on a machine with one; the CPU build of llama.cpp ignores it.
    cfg = ClusterConfig(node=node_config(model, **(node or {})), root=str(root), nodes=nodes,
                        **{"num_gpus": 1.0, **(cluster or {})})
    with LocalCluster(cfg, **kw) as c:
        yield c


def reference_tokens(model: str, prompts: list[list[int]], n_predict: int) -> list[list[int]]:
    """What one slot that never moved answers each prompt with (greedy)."""
    from actord.service.system import ActorSystem

    async def run() -> list[list[int]]:
        out = []
        async with ActorSystem(node_config(model)) as s:
            for p in prompts:
                out.append((await s.complete(prompt=p, n_predict=n_predict, slot=0, ignore_eos=True)).tokens)
                await s.slot_erase(0)
        return out

    return anyio.run(run)


def turn_req(prompt: list[int], n_predict: int = 4, **kw: Any) -> dict[str, Any]:
    return {"prompt": list(prompt), "n_predict": n_predict, "ignore_eos": True, **kw}
