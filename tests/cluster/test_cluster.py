"""Acceptance on a simulated 3-node Ray cluster with the tiny model (issue 20).

One cluster for the module (about 15 s to start on 2 cores). Each node's object store is
smaller than the 200 MB page migrated below, so that test is also "a page larger than the
object store still migrates" (Ray falls back to disk for it).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tests.cluster.clusters import NO_RAY, local_cluster, reference_tokens, turn_req

ray = pytest.importorskip("ray", reason=NO_RAY)

from actord.cluster.client import get  # noqa: E402
from actord.cluster.messages import Turn  # noqa: E402
from actord.cluster.transfer import PageBlob  # noqa: E402
from actord.vocabulary.errors import DuplicateTurn, InvalidParams, MigrationFailed, StaleEpoch  # noqa: E402
from actord.storage.pagefile import PageImage  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

OBJECT_STORE = 96 << 20
NODES = ("n1", "n2", "n3")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    with local_cluster(tmp_path_factory.mktemp("cluster"), tiny_model, object_store_memory=OBJECT_STORE) as c:
        yield c


def holders(cluster, mind):
    """Every node that holds a copy of `mind`, with its epoch."""
    out = {}
    for n in NODES:
        for h in get(cluster.node(n).holdings.remote()).unwrap():
            if h.mind == mind:
                out[n] = h.epoch
    return out


def other(node):
    return next(n for n in NODES if n != node)


def test_thirty_minds_five_turns_each_land_on_their_directory_node_through_migrations(cluster, client, tiny_model):
    minds = [f"mind{i:02d}" for i in range(30)]
    history = {m: [1, 7 + i, 40 + i, 90 + i] for i, m in enumerate(minds)}
    seen: list[tuple[list[int], list[int]]] = []
    moved: dict[str, str] = {}
    for rnd in range(5):
        if rnd == 0:  # three placed one after another, then the rest at once
            outs = [client.turn(m, turn_req(history[m])) for m in minds[:3]]
            outs += client.turns([(m, turn_req(history[m])) for m in minds[3:]])
        else:
            outs = client.turns([(m, turn_req(history[m])) for m in minds])
        for m, o in zip(minds, outs):
            entry = client.where(m)
            assert (o.node, o.epoch) == (entry.node, entry.epoch), (m, rnd)
            if rnd == 0:
                assert o.placed and o.epoch == 1
            if m in moved and rnd == 3:  # right after its migration: the new node, the new epoch
                assert o.node == moved[m] and o.epoch == 2
                assert o.result["n_cached"] > 0  # its state came along
            seen.append((list(history[m]), o.result["tokens"]))
            history[m] = history[m] + o.result["tokens"] + [5, 6]
        if rnd == 0:  # placed on distinct nodes, evenly
            counts = client.status()["nodes"]
            assert sorted(v["minds"] for v in counts.values()) == [10, 10, 10]
            assert len({client.where(m).node for m in minds[:3]}) == 3
        if rnd == 2:
            for m in minds[:4]:
                dest = other(client.where(m).node)
                info = client.migrate(m, dest)
                assert info["moved"] and info["node"] == dest and info["epoch"] == 2
                moved[m] = dest
                assert holders(cluster, m) == {dest: 2}  # exactly one owner
    # Outputs are those of one slot that never moved (a sample of them, migrated ones included).
    # The random-weight model's logits are nearly flat, so a greedy pick can flip on the last
    # bits that a KV cache built turn by turn, in batches shared with other minds, leaves apart
    # from one prefill of the whole prompt (seen in 2 of ~6 runs, one sample each). A mind whose
    # state was lost or mangled differs on every turn: one odd sample is a tie, not a bug.
    sample = seen[::9] + seen[-30:-26]
    want = reference_tokens(tiny_model, [p for p, _ in sample], 4)
    odd = [i for i, ((_, got), ref) in enumerate(zip(sample, want)) if got != ref]
    assert len(odd) <= 1, (odd, [sample[i][1] for i in odd], [want[i] for i in odd])


def test_stale_epochs_and_duplicate_turns_are_refused_and_change_nothing(cluster, client):
    out = client.turn("fence", turn_req([1, 2, 3]), turn_id="t-1")
    node = out.node
    # The same turn id again: refused, with the first answer.
    with pytest.raises(DuplicateTurn) as e:
        client.turn("fence", turn_req([1, 2, 3]), turn_id="t-1")
    assert e.value.data["result"]["tokens"] == out.result["tokens"]
    # Straight to the nodes: another node does not hold it; its node refuses an old epoch.
    for n, epoch in ((other(node), out.epoch), (node, out.epoch - 1), (node, out.epoch + 1)):
        ans = get(cluster.node(n).turn.remote(Turn(mind="fence", epoch=epoch, turn="t-x", request=turn_req([1]))))
        with pytest.raises(StaleEpoch):
            ans.unwrap()
    info = client.migrate("fence", other(node))
    ans = get(cluster.node(node).turn.remote(Turn(mind="fence", epoch=out.epoch, turn="t-y", request=turn_req([1]))))
    with pytest.raises(StaleEpoch):  # the source no longer serves it
        ans.unwrap()
    assert holders(cluster, "fence") == {info["node"]: info["epoch"]}
    # Bad input is refused at the router before anything is placed.
    with pytest.raises(InvalidParams):
        client.turn("newcomer", {"prompt": [], "n_predict": 1})
    with pytest.raises(InvalidParams):
        client.turn("../x", turn_req([1]))
    assert client.where("newcomer") is None


def test_a_200mb_page_migrates_intact_even_larger_than_the_object_store(cluster, client):
    # The tiny model's pages are kilobytes: this page's state is 200 MB of synthetic bytes
    # written as the mind's page file on its node (a page file of any state migrates the
    # same way; it is never restored into the model here).
    first = client.turn("big", turn_req([1, 2, 3]))
    src, epoch = first.node, first.epoch
    state = np.random.default_rng(7).integers(0, 256, 200 << 20, dtype=np.uint8)
    from actord.cluster.transfer import pack

    blob: PageBlob = pack("big", epoch, PageImage(tokens=list(range(1, 100)), state=memoryview(state)), [])
    get(cluster.node(src).put_page.remote("big", epoch, blob)).unwrap()
    crc = get(cluster.node(src).page_crc.remote("big")).unwrap()
    assert crc == blob.crc32
    dest = other(src)
    info = client.migrate("big", dest)
    assert info["n_bytes"] > 200 << 20 and info["zero_copy"]
    assert client.where("big").node == dest and client.where("big").epoch == epoch + 1
    assert get(cluster.node(dest).page_crc.remote("big")).unwrap() == crc
    assert get(cluster.node(src).page_crc.remote("big")).unwrap() is None  # the source copy is gone
    assert holders(cluster, "big") == {dest: epoch + 1}
    print(f"\n200 MB page {src} -> {dest}: {info['t_ms']:.0f} ms, "
          f"{info['n_bytes'] / info['t_ms'] / 1e3:.0f} MB/s (object store {OBJECT_STORE >> 20} MB per node)")


def test_the_source_dying_mid_migration_keeps_the_mind_on_it_reloaded_from_its_spill(cluster, client, tiny_model):
    prompt = [1, 11, 22, 33, 44]
    o1 = client.turn("phoenix", turn_req(prompt))
    src, epoch = o1.node, o1.epoch
    prompt2 = prompt + o1.result["tokens"] + [5]
    get(cluster.node(src).arm_fault.remote("export_after_spill"))
    with pytest.raises(MigrationFailed) as e:
        client.migrate("phoenix", other(src))
    assert e.value.data["owner"] == src
    assert (client.where("phoenix").node, client.where("phoenix").epoch) == (src, epoch)
    assert holders(cluster, "phoenix") == {src: epoch}  # never two owners
    o2 = client.turn("phoenix", turn_req(prompt2))
    assert (o2.node, o2.epoch) == (src, epoch)
    # The restarted daemon had nothing in RAM: the prefix came back from the spill.
    assert o2.result["n_cached"] > 0
    assert reference_tokens(tiny_model, [prompt2], 4) == [o2.result["tokens"]]


def test_a_streamed_turn_whose_daemon_dies_streams_each_chunk_once(cluster, client, tiny_model):
    from actord.frontends.client import Client

    sock = client.status()["router"]["socket"]
    with Client(sock, timeout=300) as c:
        r1 = c.call("completion", {"prompt": [1, 6, 12], "n_predict": 2, "mind": "stream-crash", "ignore_eos": True})
        node = client.where("stream-crash").node
        get(cluster.node(node).arm_fault.remote("turn_mid", 3))  # three chunks out, then the process dies
        prompt = [1, 6, 12] + r1["tokens"] + [4]
        chunks: list[dict] = []
        r2 = c.call("completion", {"prompt": prompt, "n_predict": 6, "mind": "stream-crash", "ignore_eos": True,
                                   "stream": True}, on_chunk=chunks.append)
    # The retry's first three chunks were not sent again: each token arrived once, in order.
    assert [t for ch in chunks for t in ch["tokens"]] == r2["tokens"] == reference_tokens(tiny_model, [prompt], 6)[0]
    assert len(chunks) == 6


@pytest.mark.parametrize("point", ["turn_mid", "turn_after_apply", "turn_after_record"])
def test_a_daemon_exiting_mid_turn_is_restarted_and_the_turn_applied_once(cluster, client, tiny_model, point):
    mind = f"crash-{point}"
    o1 = client.turn(mind, turn_req([1, 3, 5, 7]))
    node = o1.node
    before = get(cluster.node(node).health.remote())
    get(cluster.node(node).arm_fault.remote(point))
    prompt = [1, 3, 5, 7] + o1.result["tokens"] + [9]
    turn_id = f"turn-{uuid.uuid4().hex[:8]}"
    out = client.turn(mind, turn_req(prompt), turn_id=turn_id)
    after = get(cluster.node(node).health.remote())
    assert after["incarnation"] != before["incarnation"]  # Ray restarted it
    assert out.attempts == 2 and out.node == node and out.turn == turn_id
    assert out.result["tokens"] == reference_tokens(tiny_model, [prompt], 4)[0]
    load = get(cluster.node(node).load.remote()).unwrap()
    # Applied once: recorded once as the mind's last turn; after a crash past the record,
    # the restarted daemon did not run it again (the recorded answer came back).
    assert [h.last_turn for h in get(cluster.node(node).holdings.remote()).unwrap() if h.mind == mind] == [turn_id]
    assert load.turns_applied == (0 if point == "turn_after_record" else 1)
    with pytest.raises(DuplicateTurn):
        client.turn(mind, turn_req(prompt), turn_id=turn_id)


def test_the_router_socket_speaks_the_daemons_protocol(cluster, client):
    from actord.frontends.client import Client

    sock = client.status()["router"]["socket"]
    with Client(sock, timeout=120) as c:
        r = c.call("completion", {"prompt": [1, 4, 9], "n_predict": 3, "mind": "socket-mind", "ignore_eos": True})
        assert len(r["tokens"]) == 3
        assert c.call("health")["status"] == "ok"
        st = c.call("cluster.status")
        assert "socket-mind" in st["minds"]
        with pytest.raises(InvalidParams):
            c.call("completion", {"prompt": [1], "n_predict": 1})  # no mind
        chunks: list[dict] = []
        r2 = c.call("completion", {"prompt": [1, 4, 9] + r["tokens"] + [2], "n_predict": 5, "mind": "socket-mind",
                                   "ignore_eos": True, "stream": True}, on_chunk=chunks.append)
        assert [t for ch in chunks for t in ch["tokens"]] == r2["tokens"] and len(chunks) == 5
        assert "".join(ch["content"] for ch in chunks) == r2["content"]
        assert r2["n_cached"] > 0


def test_a_restarted_router_knows_every_owner_from_its_directory(cluster, client):
    o1 = client.turn("steady", turn_req([1, 8, 16]))
    before = client.status()
    ray.kill(cluster.router, no_restart=False)  # Ray restarts it; its memory is gone
    o2 = client.turn("steady", turn_req([1, 8, 16] + o1.result["tokens"] + [3]))
    after = client.status()
    assert after["router"]["incarnation"] != before["router"]["incarnation"]
    assert (o2.node, o2.epoch, o2.placed) == (o1.node, o1.epoch, False)
    assert o2.result["n_cached"] > 0
    assert after["minds"] == {**before["minds"], "steady": before["minds"]["steady"]}


def test_the_router_killed_9_serves_its_socket_again_with_no_client_calling_it(cluster, client):
    """Issue 33: Ray restarts the router, and the nodes' calls (router.py `ping`) start its
    socket again; before, it stayed closed until some client made a Ray call. Only the
    socket is used while waiting: nothing here calls the router through Ray."""
    import os
    import signal
    import socket as _socket

    from actord.frontends.client import Client
    from actord.vocabulary.errors import NodeUnavailable

    before = client.status()["router"]
    os.kill(before["pid"], signal.SIGKILL)
    while True:  # what the restart must produce: the socket answering, from a new incarnation
        try:
            with Client(before["socket"], timeout=30) as c:
                health = c.call("health")
            if health["router"] != before["incarnation"]:
                break
        except (OSError, _socket.timeout, ConnectionError, NodeUnavailable):
            pass  # refused or gone until a node stands in for the router (standin.py), then typed
    assert client.status()["router"]["incarnation"] == health["router"]


def test_while_the_router_is_down_its_socket_answers_a_typed_unavailable_until_it_is_back(cluster, client):
    """Issue 33: between the router's death and its restart, a node on its machine stands
    in for its socket (actord/cluster/standin.py): clients get NodeUnavailable, not a
    refused connection. The router is killed without restart here, so the stand-in is
    surely seen; then it is started again as Ray would, and takes its socket back."""
    from actord.cluster.local import start_router
    from actord.frontends.client import Client
    from actord.vocabulary.errors import NodeUnavailable

    o1 = client.turn("standin-mind", turn_req([1, 5, 9]))
    before = client.status()["router"]
    ray.kill(cluster.router, no_restart=True)
    while True:  # refused only until a node sees the router's process gone and stands in
        try:
            with Client(before["socket"], timeout=30) as c:
                c.call("health")
        except NodeUnavailable as e:
            assert e.data["router"] is True
            break
        except OSError:
            pass
    with Client(before["socket"], timeout=30) as c, pytest.raises(NodeUnavailable):
        c.call("completion", {"prompt": [1, 5, 9], "n_predict": 2, "mind": "standin-mind"})
    cluster.router = client.router = start_router(cluster.cfg, cluster.cluster.head_node.node_id)
    while True:  # the stand-in answers until the nodes see the router back; never a refusal after it
        try:
            with Client(before["socket"], timeout=30) as c:
                health = c.call("health")
            if health["router"] != before["incarnation"]:
                break
        except NodeUnavailable:
            pass
        except OSError:
            pass  # the moment between the stand-in closing and the router binding its path again
    o2 = client.turn("standin-mind", turn_req([1, 5, 9] + o1.result["tokens"] + [3]))
    assert (o2.node, o2.epoch, o2.placed) == (o1.node, o1.epoch, False)  # its directory survived
