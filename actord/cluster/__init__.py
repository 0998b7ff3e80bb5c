"""actord past one machine, on Ray (the optional extra `actord[ray]`; issue 20).

One `NodeDaemon` per Ray node hosts today's `ActorSystem` unchanged; one `MindRouter` owns
the directory mind -> (node, epoch) and routes every turn as (mind, epoch, turn id). The
single-node daemon does not import this package.

    durable.py    crash-safe small JSON files (write temp, fsync, rename, fsync the folder)
    directory.py  the router's directory: mind -> (node, epoch), every change persisted
    fence.py      a node's epochs and applied turns: stale epochs and duplicate turns refused
    transfer.py   a page-file generation <-> numpy arrays for the object store, with a checksum
    messages.py   the Structs the router and the daemons exchange
    placer.py     the node's mind placer, with the two verbs migration needs
    node.py       the NodeDaemon Ray actor
    nodelink.py   the router's calls to its nodes over Ray, their loads, what counts as a node gone
    router.py     the MindRouter Ray actor: its state, its start, node registration, status
    turns.py      the router's turns: one mind's on its node, retried once; a request of no mind
    migration.py  the router's migrate and rebalance: export, adopt, flip the directory, release
    loss.py       the router's monitor of Ray's nodes, and the re-homing of a lost node's minds
    rpc.py        the router's JSON-RPC socket (the daemon's protocol)
    front.py      the OpenAI HTTP front served at the router (the single-node front's code)
    local.py      a cluster on this machine (ray.cluster_utils.Cluster) and its handles
    client.py     the driver-side client: turns, migration, status
    cli.py        `actord cluster up|status|down`
"""

from __future__ import annotations


def require_ray() -> object:
    """Import ray, or say how to get it."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the actord cluster needs Ray: pip install 'actord[ray]'") from e
    return ray
