"""A node writes its idle minds behind (`write_behind_s`), as `actord serve` does: a mind
idle past the window on a node that is then lost comes back elsewhere from her page file,
processing only her new tokens. Before, a node never ran write-behind, so every mind not
spilled by hand was re-prefilled after her node's loss, however long she had been idle."""

from __future__ import annotations

import pytest

from tests.cluster.clusters import NO_RAY, local_cluster, reference_tokens, turn_req
from tests.waits import wait_until

ray = pytest.importorskip("ray", reason=NO_RAY)

from actord.cluster.local import FAST_HEALTH  # noqa: E402
from actord.cluster.node import node_dir  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("wb")
    with local_cluster(root, tiny_model, nodes=2, node={"write_behind_s": 0.5}, system_config=FAST_HEALTH) as c:
        c.root_dir = root
        yield c


def test_a_mind_idle_past_the_window_on_a_lost_node_comes_back_from_her_file(cluster, client, tiny_model):
    history = [1, 51, 61, 71, 81]
    first = client.turns([("w", turn_req(history))])[0]
    history += first.result["tokens"] + [5]
    victim = first.node
    page = node_dir(cluster.root_dir, victim) / "pages" / "w.page"
    wait_until(page.exists, "her page file written behind", timeout=60, every=0.1)
    cluster.remove_node(victim)
    wait_until(lambda: [e for e in client.lost_events() if e["node"] == victim and "done" in e],
               f"node {victim} declared lost and its minds re-homed", timeout=120, every=0.1)
    again = client.turns([("w", turn_req(history))])[0]
    assert again.node != victim
    assert again.result["n_cached"] >= len(history) - 2  # from her file, not a prefill
    assert reference_tokens(tiny_model, [history], 4) == [again.result["tokens"]]
