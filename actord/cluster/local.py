"""A cluster on this machine: Ray's `cluster_utils.Cluster` (a head and one raylet per
simulated node, made-up GPU counts), a NodeDaemon on each node, the MindRouter on the head.

With `node.http` set, `up` has the router serve the OpenAI HTTP front (front.py) once
the nodes are registered. `start_node` and `start_router` are what a real cluster uses too (`connect` joins an
existing Ray cluster instead of making one): the daemons are detached named actors, so
they outlive the driver that started them.

Facts this relies on (ray 2.60): `node_ip_address="127.0.0.1"`,
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` and `RAY_USAGE_STATS_ENABLED=0`; an actor given
`num_gpus` also holds a CPU unless `num_cpus=0`; `ray.shutdown()` before `cluster.shutdown()`.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import msgspec

from actord.vocabulary.config import ClusterConfig
from actord.vocabulary.log import get

log = get("actord.cluster.local")

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from actord.cluster.node import NodeDaemon  # noqa: E402
from actord.cluster.nodelink import node_actor_name  # noqa: E402
from actord.cluster.router import ROUTER_NAME, MindRouter  # noqa: E402

# Health checks for a simulated cluster: a node that stops answering is dead after about
# period x threshold (Ray's defaults take about 66 s on these machines).
FAST_HEALTH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
               "health_check_timeout_ms": 2000, "health_check_failure_threshold": 5}

RemoteNode = ray.remote(concurrency_groups={"control": 2})(NodeDaemon)
RemoteRouter = ray.remote(MindRouter)


def _json(cfg: ClusterConfig) -> bytes:
    return msgspec.json.encode(cfg)


def start_node(cfg: ClusterConfig, name: str, ray_node_id: str) -> Any:
    """A NodeDaemon named `actord-node-NAME`, pinned to Ray node `ray_node_id`."""
    handle = RemoteNode.options(
        name=node_actor_name(name), namespace=cfg.namespace, lifetime="detached", num_cpus=0,
        num_gpus=cfg.num_gpus, max_restarts=-1, max_task_retries=0, max_concurrency=256,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
    ).remote(name, _json(cfg))
    ray.get(handle.start.remote()).unwrap()
    return handle


def start_router(cfg: ClusterConfig, ray_node_id: str | None = None) -> Any:
    opts: dict[str, Any] = dict(name=ROUTER_NAME, namespace=cfg.namespace, lifetime="detached", num_cpus=0,
                                max_restarts=-1, max_task_retries=0, max_concurrency=1024, get_if_exists=True)
    if ray_node_id is not None:
        # Hard: on a soft affinity Ray may start it on a worker node (seen here), which a
        # node loss then takes down with its minds' directory service.
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray_node_id, soft=False)
    handle = RemoteRouter.options(**opts).remote(_json(cfg))
    ray.get(handle.ping.remote())
    return handle


class LocalCluster:
    """`with LocalCluster(cfg) as c:` a head plus `cfg.nodes` simulated nodes, each with a
    daemon registered with the router."""

    def __init__(self, cfg: ClusterConfig, *, system_config: dict[str, Any] | None = None,
                 object_store_memory: int | None = None, node_cpus: int = 1) -> None:
        self.cfg = cfg.validate()
        self.system_config = system_config
        self.object_store_memory = object_store_memory
        self.node_cpus = node_cpus
        self.cluster: Any = None
        self.ray_nodes: dict[str, Any] = {}  # name -> ray._private.node.Node
        self.router: Any = None
        self._n = 0

    def __enter__(self) -> "LocalCluster":
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def up(self) -> "LocalCluster":
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        # Loopback only. Ray reads this variable when it is imported: where ray was imported
        # before this module set it, the constant it became is set too (else ray.init
        # resolves 127.0.0.1 to the machine's outward address and never finds the GCS).
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False

        head: dict[str, Any] = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "resources": {"actord_head": 1}}
        system_config = {**self.cfg.ray_system_config(), **(self.system_config or {})}
        if system_config:
            head["_system_config"] = system_config
        if self.object_store_memory:
            head["object_store_memory"] = self.object_store_memory
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            names = [self._add_ray_node() for _ in range(self.cfg.nodes)]
            ray.init(address=self.cluster.address, namespace=self.cfg.namespace, log_to_driver=False)
            self.router = start_router(self.cfg, self.cluster.head_node.node_id)
            for name in names:
                start_node(self.cfg, name, self.ray_nodes[name].node_id)
                ray.get(self.router.register_node.remote(name))
            if self.cfg.node.http:  # the OpenAI front, in the router (front.py): needs a node for the model
                ray.get(self.router.serve_http.remote())
        except BaseException:
            self.down()
            raise
        log.info("cluster.local_up", address=self.cluster.address, nodes=names)
        return self

    def _add_ray_node(self) -> str:
        self._n += 1
        name = f"n{self._n}"
        args: dict[str, Any] = {"num_cpus": self.node_cpus, "num_gpus": max(1, int(self.cfg.num_gpus or 1)),
                                "node_ip_address": "127.0.0.1", "resources": {f"actord_{name}": 1}}
        if self.object_store_memory:
            args["object_store_memory"] = self.object_store_memory
        self.ray_nodes[name] = self.cluster.add_node(**args)
        return name

    @property
    def address(self) -> str:
        return self.cluster.address

    def node(self, name: str) -> Any:
        return ray.get_actor(node_actor_name(name), namespace=self.cfg.namespace)

    def add_node(self, rebalance: bool = True) -> tuple[str, Any]:
        """One more simulated node with its daemon; minds rebalance onto it."""
        name = self._add_ray_node()
        rid = self.ray_nodes[name].node_id
        for _ in range(600):  # not wait_for_nodes: it waits for hung nodes too
            if any(n["NodeID"] == rid and n["Alive"] for n in ray.nodes()):
                break
            time.sleep(0.1)
        start_node(self.cfg, name, self.ray_nodes[name].node_id)
        return name, ray.get(self.router.register_node.remote(name, rebalance))

    def remove_node(self, name: str) -> None:
        """The node goes away (its raylet and workers killed), as a machine lost."""
        self.cluster.remove_node(self.ray_nodes.pop(name), allow_graceful=False)

    def raylet_pid(self, name: str) -> int:
        from ray._private import ray_constants

        return self.ray_nodes[name].all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid

    def stop_raylet(self, name: str) -> int:
        """SIGSTOP the node's raylet: it hangs, health checks declare the node dead."""
        pid = self.raylet_pid(name)
        os.kill(pid, signal.SIGSTOP)
        self._stopped = getattr(self, "_stopped", []) + [pid]
        return pid

    def down(self) -> None:
        for pid in getattr(self, "_stopped", []):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if ray.is_initialized():
            for name in list(self.ray_nodes):
                try:
                    ray.kill(self.node(name), no_restart=True)
                except Exception:
                    pass
            try:
                ray.kill(ray.get_actor(ROUTER_NAME, namespace=self.cfg.namespace), no_restart=True)
            except Exception:
                pass
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
