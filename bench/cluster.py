"""The cluster on a simulated Ray cluster: turns/s with 1, 2 and 3 nodes, and migration
against a plain copy of the same bytes, side by side.

Turns/s: the same workload (M minds x T turns of the tiny generated llama, greedy, each
turn the mind's whole history plus a new token, `n_predict` tokens; all minds' turns of a
round in flight at once) on a fresh local cluster of 1, 2 and 3 nodes, and beside them one
in-process `ActorSystem` with no Ray at all (the single-node daemon's cost for the same
turns). On a machine with fewer cores than nodes the nodes share cores: the scaling shown
is then the routing's overhead and how well the nodes overlap, not more compute.

Migration: a mind's page file of S MB (synthetic state bytes: the tiny model's pages are
kilobytes) moved node 1 -> node 2 by the router (export: page out, read the page file,
numpy into the object store; the destination reads it in place, checks its CRC-32, writes
it crash-safely; the directory flips; the source drops its copy), measured against, on the
same machine at the same moment: a plain file copy of that page file (read, write, fsync)
and Ray's object transfer alone (a uint8 array made on node 1, read on node 2).

    .venv/bin/python bench/cluster.py [--minds 12] [--turns 6] [--n-predict 8] [--sizes 16,64,200]

Each figure is the median of 3 runs (migrations go back and forth). About 4 minutes on 2 shared
cores, whose other tenants move these figures by 2x and more between runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import numpy as np  # noqa: E402

from actord.vocabulary import log  # noqa: E402
from actord.vocabulary.config import ClusterConfig, Config  # noqa: E402
from actord.testing.models import write_tiny_llama  # noqa: E402

log.configure(level="error")

REPEATS = 3  # each figure is the median of this many runs, measured in the same process


def node_config(model: str) -> Config:
    return Config(model=model, slots=2, ctx=2048, batch=64, threads=1)


def workload(minds: int, turns: int) -> list[list[tuple[str, list[int]]]]:
    hist = {f"b{i:02d}": [1, 30 + i, 60 + i, 90 + i] for i in range(minds)}
    return [[(m, h) for m, h in hist.items()] for _ in range(turns)]


def run_cluster(model: str, root: Path, nodes: int, minds: int, turns: int, n_predict: int) -> float:
    from actord.cluster.client import ClusterClient
    from actord.cluster.local import LocalCluster

    cfg = ClusterConfig(node=node_config(model), root=str(root / f"tps{nodes}"), nodes=nodes, log_level="error")
    with LocalCluster(cfg, object_store_memory=256 << 20) as c:
        cl = ClusterClient(c.router)
        hist = {f"b{i:02d}": [1, 30 + i, 60 + i, 90 + i] for i in range(minds)}
        req = lambda p: {"prompt": p, "n_predict": n_predict, "ignore_eos": True}  # noqa: E731
        for o, m in zip(cl.turns([(m, req(h)) for m, h in hist.items()]), hist):  # placement, warm-up
            hist[m] = hist[m] + o.result["tokens"] + [5]
        rates = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            for _ in range(turns):
                for o, m in zip(cl.turns([(m, req(h)) for m, h in hist.items()]), list(hist)):
                    hist[m] = hist[m] + o.result["tokens"] + [5]
            rates.append(minds * turns / (time.perf_counter() - t0))
        return statistics.median(rates)


def run_single(model: str, minds: int, turns: int, n_predict: int) -> float:
    from actord.service.system import ActorSystem

    async def go() -> float:
        async with ActorSystem(node_config(model)) as s:
            hist = {f"b{i:02d}": [1, 30 + i, 60 + i, 90 + i] for i in range(minds)}

            async def one(m: str) -> None:
                r = await s.complete(prompt=hist[m], n_predict=n_predict, mind=m, ignore_eos=True)
                hist[m] = hist[m] + r.tokens + [5]

            async def rnd() -> None:
                async with anyio.create_task_group() as tg:
                    for m in list(hist):
                        tg.start_soon(one, m)

            await rnd()
            rates = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                for _ in range(turns):
                    await rnd()
                rates.append(minds * turns / (time.perf_counter() - t0))
            return statistics.median(rates)

    return anyio.run(go)


def plain_copy(src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    with open(src, "rb") as f, open(dst, "wb") as g:
        shutil.copyfileobj(f, g, 16 << 20)
        g.flush()
        os.fsync(g.fileno())
    return time.perf_counter() - t0


def migrations(model: str, root: Path, sizes_mb: list[int]) -> list[dict]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actord.serving.placer import mind_file
    from actord.cluster.client import ClusterClient, get
    from actord.cluster.local import LocalCluster
    from actord.cluster.transfer import pack
    from actord.storage.pagefile import PageImage

    cfg = ClusterConfig(node=node_config(model), root=str(root / "mig"), nodes=2, log_level="error")
    rows = []
    with LocalCluster(cfg, object_store_memory=1 << 30) as c:
        cl = ClusterClient(c.router)
        ids = {n: c.ray_nodes[n].node_id for n in ("n1", "n2")}

        @ray.remote(num_cpus=0)
        def make(n: int) -> np.ndarray:
            return np.ones(n, dtype=np.uint8)

        @ray.remote(num_cpus=0)
        def touch(a: np.ndarray) -> int:
            return int(a[-1]) + a.nbytes

        warm = make.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids["n1"], soft=False)).remote(1 << 20)
        ray.get(touch.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids["n2"], soft=False)).remote(warm))
        for size in sizes_mb:
            mind = f"mig{size}"
            o = cl.turn(mind, {"prompt": [1, 2, 3], "n_predict": 1})
            src = o.node
            dst = "n2" if src == "n1" else "n1"
            state = np.random.default_rng(size).integers(0, 256, size << 20, dtype=np.uint8)
            blob = pack(mind, o.epoch, PageImage(tokens=list(range(1, 64)), state=memoryview(state)), [])
            get(c.node(src).put_page.remote(mind, o.epoch, blob)).unwrap()
            del blob
            page = Path(cfg.root) / "nodes" / src / "pages" / mind_file(mind)
            n_file = page.stat().st_size
            t_copy, t_ray, t_mig = [], [], []
            crc = get(c.node(src).page_crc.remote(mind)).unwrap()
            for _ in range(REPEATS):  # back and forth: each step measured beside the other two
                page = Path(cfg.root) / "nodes" / src / "pages" / mind_file(mind)
                t_copy.append(plain_copy(page, root / "plain-copy.bin"))
                (root / "plain-copy.bin").unlink()
                ref = make.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids[src], soft=False)).remote(
                    size << 20)
                ray.wait([ref])
                t0 = time.perf_counter()
                ray.get(touch.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids[dst], soft=False)).remote(
                    ref))
                t_ray.append(time.perf_counter() - t0)
                del ref
                t0 = time.perf_counter()
                info = cl.migrate(mind, dst)
                t_mig.append(time.perf_counter() - t0)
                assert get(c.node(dst).page_crc.remote(mind)).unwrap() == crc
                src, dst = dst, src
            rows.append({"mb": size, "n_file": n_file, "mig": statistics.median(t_mig),
                         "copy": statistics.median(t_copy), "ray": statistics.median(t_ray),
                         "zero_copy": info["zero_copy"]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minds", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--n-predict", type=int, default=8)
    ap.add_argument("--sizes", default="16,64,200", help="page sizes in MB")
    ap.add_argument("--nodes", default="1,2,3")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = str(write_tiny_llama(root / "tiny.gguf", seed=1))
        print(f"workload: {a.minds} minds x {a.turns} turns (median of {REPEATS}), n_predict {a.n_predict}, tiny llama; "
              f"{os.cpu_count()} CPUs on this machine")
        single = run_single(model, a.minds, a.turns, a.n_predict)
        print(f"  one ActorSystem, no Ray:  {single:7.1f} turns/s")
        base = None
        for n in [int(x) for x in a.nodes.split(",")]:
            tps = run_cluster(model, root, n, a.minds, a.turns, a.n_predict)
            base = base or tps
            print(f"  cluster, {n} node(s):       {tps:7.1f} turns/s   x{tps / base:.2f} vs 1 node, "
                  f"x{tps / single:.2f} vs no Ray")
        print("migration node 1 -> node 2 vs the same bytes copied plainly (object store 1 GB per node):")
        print(f"  {'page':>6} {'migrate':>9} {'MB/s':>7} | {'file copy+fsync':>15} {'MB/s':>7} | "
              f"{'Ray transfer':>12} {'MB/s':>7} | migrate/copy  migrate/ray")
        for r in migrations(model, root, [int(x) for x in a.sizes.split(",")]):
            mb = r["n_file"] / 1e6
            print(f"  {r['mb']:>4}MB {r['mig'] * 1e3:>7.0f}ms {mb / r['mig']:>7.0f} | {r['copy'] * 1e3:>13.0f}ms "
                  f"{mb / r['copy']:>7.0f} | {r['ray'] * 1e3:>10.0f}ms {mb / r['ray']:>7.0f} | "
                  f"{r['mig'] / r['copy']:>11.2f}x {r['mig'] / r['ray']:>11.2f}x"
                  + ("" if r["zero_copy"] else "  (destination copied)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
