"""A lost node's minds are served again elsewhere; a node added later takes minds over.

One cluster for the module, with Ray's health checks tuned (local.FAST_HEALTH: a node that
stops answering is declared dead after about 5 x 1 s, against about 66 s by default).
The tests run in order on it: a node removed (`remove_node`), a node whose raylet is
SIGSTOPped, then a node added.
"""

from __future__ import annotations

import pytest

from tests.cluster.clusters import NO_RAY, local_cluster, reference_tokens, turn_req
from tests.waits import wait_until

ray = pytest.importorskip("ray", reason=NO_RAY)

from actord.cluster.local import FAST_HEALTH  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

MINDS = [f"r{i}" for i in range(6)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    # Write-behind off: a mind persisted by hand against one only in RAM (test_node_write_behind.py: on).
    with local_cluster(tmp_path_factory.mktemp("loss"), tiny_model, node={"write_behind_s": 0},
                       system_config=FAST_HEALTH) as c:
        yield c


@pytest.fixture(scope="module")
def history():
    return {m: [1, 50 + i, 60 + i, 70 + i] for i, m in enumerate(MINDS)}


def step(client, history, minds):
    outs = client.turns([(m, turn_req(history[m])) for m in minds])
    for m, o in zip(minds, outs):
        history[m] = history[m] + o.result["tokens"] + [5]
    return dict(zip(minds, outs))


def wait_rehomed(client, node):
    """The loss event, once the router has re-homed every mind of `node` (the bound is a hang
    guard, not a measure)."""
    done = wait_until(lambda: [e for e in client.lost_events() if e["node"] == node and "done" in e],
                      f"node {node} declared lost and its minds re-homed", timeout=120, every=0.1)
    return done[0]


def check_rehomed(client, history, tiny_model, victim, on_victim, durable, before):
    event = wait_rehomed(client, victim)
    prompts = {m: list(history[m]) for m in on_victim}
    outs = step(client, history, on_victim)
    for m, o in outs.items():
        assert o.node != victim and o.epoch > before[m].epoch
        assert (o.node, o.epoch) == (client.where(m).node, client.where(m).epoch)
    # From its page file in the shared folder (its prefix cached), or re-prefilled.
    assert outs[durable].result["n_cached"] > 0
    for m in on_victim:
        if m != durable:
            assert outs[m].result["n_cached"] == 0
    assert reference_tokens(tiny_model, [prompts[m] for m in on_victim], 4) == [outs[m].result["tokens"]
                                                                                   for m in on_victim]
    after = {r["mind"]: r["after_s"] for r in event["rehomed"]}
    print(f"\n{victim} lost: minds re-homed {after} s after detection")
    return outs


def test_a_removed_nodes_minds_are_served_elsewhere(cluster, client, history, tiny_model):
    first = step(client, history, MINDS)
    victim = first[MINDS[0]].node
    on_victim = [m for m in MINDS if first[m].node == victim]
    assert len(on_victim) == 2
    client.persist(on_victim[0])  # this one's state is in its page file; the other's only in RAM
    cluster.remove_node(victim)
    check_rehomed(client, history, tiny_model, victim, on_victim, on_victim[0], first)


def test_a_hung_raylet_is_declared_dead_and_its_minds_move(cluster, client, history, tiny_model):
    now = step(client, history, MINDS)
    live = sorted({o.node for o in now.values()})
    assert len(live) == 2
    victim = live[0]
    on_victim = [m for m in MINDS if now[m].node == victim]
    client.persist(on_victim[0])
    cluster.stop_raylet(victim)  # SIGSTOP: the node hangs rather than goes
    check_rehomed(client, history, tiny_model, victim, on_victim, on_victim[0], now)
    assert {client.where(m).node for m in MINDS} == {live[1]}


def test_an_added_node_takes_minds_over(cluster, client, history):
    before = {m: client.where(m) for m in MINDS}
    name, reg = cluster.add_node()
    moved = {mv["mind"] for mv in reg["moved"]}
    assert len(moved) == 3 and all(mv["node"] == name for mv in reg["moved"])
    outs = step(client, history, MINDS)
    for m, o in outs.items():
        assert (o.node, o.epoch) == (client.where(m).node, client.where(m).epoch)
        assert (o.node == name) == (m in moved)
        assert o.result["n_cached"] > 0  # moved ones too: their state came along
        if m in moved:
            assert o.epoch == before[m].epoch + 1
