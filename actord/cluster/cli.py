"""`actord cluster up|status|down`: a cluster of simulated nodes on this machine.

    actord cluster up --nodes 3 --root ./actord-cluster --model M.gguf [node flags as `serve`'s]
    actord cluster status [--root ./actord-cluster]
    actord cluster down   [--root ./actord-cluster]

`up` starts a keeper process (detached) that owns the local Ray cluster (a head and one
raylet per node), the NodeDaemons and the MindRouter, and writes `ROOT/cluster.json`
(the Ray address, the router's socket, its HTTP address, the keeper's pid) once everything
answers; it returns then. Clients reach the cluster through the router's JSON-RPC socket,
as they reach one daemon (`actord --socket ROOT/router/actord.sock call completion
'{"mind": ...}'`), through the OpenAI HTTP front the router serves with `--http HOST:PORT`
(and `--api-key KEY`, as `serve`'s: `base_url="http://HOST:PORT/v1"`, front.py), or as Ray
drivers (`ray.init(address=...)`, `actord.cluster.client.ClusterClient`).
`status` asks the router over its socket; `down` stops the keeper, which stops the actors,
then `ray.shutdown()`, then the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from actord.frontends.config_flags import add_config_flags, config_from_args
from actord.vocabulary.config import ClusterConfig
from actord.vocabulary import log as actord_log
from actord.vocabulary.errors import ActordError

STATE = "cluster.json"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="actord cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="start a local cluster (returns once it answers)")
    up.add_argument("--root", default="./actord-cluster")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--num-gpus-per-node", type=float, default=0.0, dest="num_gpus")
    up.add_argument("--durable-turns", action="store_true")
    up.add_argument("--cluster-socket", default=None, help="the router's socket (default ROOT/router/actord.sock)")
    up.add_argument("--timeout-s", type=float, default=300.0)
    up.add_argument("--health-check-period-ms", type=int, default=0, help="Ray's node health checks (0: its default)")
    up.add_argument("--health-check-timeout-ms", type=int, default=0)
    up.add_argument("--health-check-failure-threshold", type=int, default=0)
    add_config_flags(up)
    for verb in ("status", "down"):
        v = sub.add_parser(verb)
        v.add_argument("--root", default="./actord-cluster")
    keep = sub.add_parser("keep", help=argparse.SUPPRESS)
    keep.add_argument("config_json")
    return ap


def main(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    if ns.verb == "up":
        return _up(ns)
    if ns.verb == "keep":
        return _keep(ns.config_json)
    state = _state(Path(ns.root))
    if state is None:
        print(f"no cluster at {ns.root} ({STATE} not found)", file=sys.stderr)
        return 2
    if ns.verb == "status":
        from actord.frontends.client import Client

        try:
            with Client(state["socket"], timeout=60) as c:
                print(json.dumps(c.call("cluster.status"), indent=2))
        except OSError as e:
            print(f"cannot reach the router at {state['socket']}: {e}", file=sys.stderr)
            return 2
        return 0
    return _down(Path(ns.root), state)


def _state(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / STATE).read_text())
    except FileNotFoundError:
        return None


def _up(ns: argparse.Namespace) -> int:
    from actord.cluster import require_ray

    try:
        require_ray()
    except ImportError as e:
        print(f"actord cluster up: {e}", file=sys.stderr)
        return 2
    root = Path(ns.root).resolve()
    if _state(root) is not None:
        print(f"a cluster is already up at {root} (actord cluster down --root {ns.root})", file=sys.stderr)
        return 2
    try:
        node = config_from_args(ns)
        cfg = ClusterConfig(node=node, root=str(root), nodes=ns.nodes, num_gpus=ns.num_gpus,
                            durable_turns=ns.durable_turns, socket=ns.cluster_socket,
                            health_check_period_ms=ns.health_check_period_ms,
                            health_check_timeout_ms=ns.health_check_timeout_ms,
                            health_check_failure_threshold=ns.health_check_failure_threshold).validate()
    except ActordError as e:
        print(f"actord cluster up: {e.message}", file=sys.stderr)
        return 2
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "keeper.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "actord.cli", "cluster", "keep", msgspec.json.encode(cfg).decode()],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + ns.timeout_s
    while time.monotonic() < deadline:
        state = _state(root)
        if state is not None:
            print(json.dumps(state, indent=2))
            return 0
        if proc.poll() is not None:
            print(f"the cluster did not start (exit {proc.returncode}); see {root / 'keeper.log'}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    proc.terminate()
    print(f"the cluster did not answer within {ns.timeout_s} s; see {root / 'keeper.log'}", file=sys.stderr)
    return 1


def _keep(config_json: str) -> int:
    from actord.cluster.durable import write_json

    cfg = msgspec.json.decode(config_json.encode(), type=ClusterConfig)
    actord_log.configure(level="info")
    from actord.cluster.client import ClusterClient
    from actord.cluster.local import LocalCluster

    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    root = Path(cfg.root)
    with LocalCluster(cfg) as c:
        st = ClusterClient(c.router).status()
        write_json(root / STATE, {"address": c.address, "namespace": cfg.namespace, "socket": st["router"]["socket"],
                                  "http": st["router"]["http"], "keeper_pid": os.getpid(),
                                  "nodes": sorted(st["nodes"])})
        try:
            while not stop["now"]:
                time.sleep(0.2)
        finally:
            (root / STATE).unlink(missing_ok=True)
    return 0


def _down(root: Path, state: dict[str, Any]) -> int:
    pid = int(state["keeper_pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        (root / STATE).unlink(missing_ok=True)
        print("the keeper was gone; state removed")
        return 0
    for _ in range(600):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        print(f"the keeper (pid {pid}) did not stop within 60 s", file=sys.stderr)
        return 1
    print(json.dumps({"down": str(root)}))
    return 0
