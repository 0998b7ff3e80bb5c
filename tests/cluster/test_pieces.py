"""The cluster's pure pieces, without Ray: the directory, the fences, the page transport."""

from __future__ import annotations

import numpy as np
import pytest

from actord.cluster.directory import Directory
from actord.cluster.fence import FenceBook
from actord.cluster.transfer import pack, unpack
from actord.vocabulary.errors import CorruptPageFile, DuplicateTurn, InvalidParams, StaleEpoch
from actord.policy.checkpoint_records import StoredCheckpoint
from actord.storage.pagefile import PageImage


def test_directory_persists_every_change_and_never_issues_an_epoch_twice(tmp_path):
    d = Directory(tmp_path / "dir.json")
    d.add_node("n1"), d.add_node("n2")
    e1 = d.issue("ada")
    d.assign("ada", "n1", e1)
    e2 = d.issue("ada")  # a migration that is then abandoned: its epoch is spent
    again = Directory(tmp_path / "dir.json")  # a restarted router
    assert again.get("ada").node == "n1" and again.get("ada").epoch == e1
    assert again.issue("ada") == e2 + 1
    with pytest.raises(InvalidParams):
        again.assign("ada", "n2", e1)  # not newer
    with pytest.raises(InvalidParams):
        again.assign("ada", "n2", 99)  # never issued
    assert again.get("ada").node == "n1"  # refused, nothing changed
    again.mark_lost("n1")
    assert Directory(tmp_path / "dir.json").live_nodes() == ["n2"]


def test_fences_refuse_stale_epochs_and_duplicate_turns_and_survive_a_restart(tmp_path):
    f = FenceBook(tmp_path, keep=3)
    with pytest.raises(StaleEpoch):
        f.check("ada", 1, "t1")  # not held here
    f.hold("ada", 2)
    with pytest.raises(StaleEpoch) as e:
        f.check("ada", 1, "t1")
    assert e.value.data["held"] == 2
    f.check("ada", 2, "t1")
    f.record("ada", 2, "t1", {"tokens": [1, 2]})
    again = FenceBook(tmp_path, keep=3)
    with pytest.raises(DuplicateTurn) as d:
        again.check("ada", 2, "t1")
    assert d.value.data["result"] == {"tokens": [1, 2]}
    for i in range(2, 6):
        again.record("ada", 2, f"t{i}", i)
    assert [t.turn for t in again.turns("ada")] == ["t3", "t4", "t5"]  # the last `keep`
    again.drop("ada")
    assert FenceBook(tmp_path).held("ada") is None


def test_a_page_travels_as_numpy_views_and_a_flipped_byte_is_caught():
    state = bytearray(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    image = PageImage(tokens=[1, 2, 3], state=state, checkpoints=[StoredCheckpoint(pos=2, data=bytearray(b"ck"))],
                      meta={"n_ctx": 64}, divergences=[(1, 2)], prompt_end=3)
    blob = pack("ada", 1, image, [])
    assert np.shares_memory(blob.state, np.frombuffer(state, dtype=np.uint8))  # no copy at the source
    back = unpack(blob)
    assert bytes(back.state) == bytes(state) and back.tokens == [1, 2, 3] and back.checkpoints[0].pos == 2
    assert back.divergences == [(1, 2)] and back.prompt_end == 3
    blob.state[7] ^= 1
    with pytest.raises(CorruptPageFile):
        unpack(blob)


def test_a_page_on_a_shared_prefix_travels_with_its_base_and_a_flipped_base_byte_is_caught():
    """A spilled page on a base (serving/page_bases.py) is its own part plus the base's
    state: both travel, so the node that takes the mind restores all of it."""
    rest, base = bytearray(b"rest" * 64), bytearray(b"base" * 256)
    image = PageImage(tokens=list(range(1, 12)), state=rest, base=base, n_base=8, meta={"n_ctx": 64})
    blob = pack("ada", 1, image, [])
    back = unpack(blob)
    assert bytes(back.base) == bytes(base) and back.n_base == 8 and bytes(back.state) == bytes(rest)
    blob.base[3] ^= 1
    with pytest.raises(CorruptPageFile):
        unpack(blob)


def test_a_router_restart_outlasting_the_wait_is_a_typed_unavailable():
    pytest.importorskip("ray")
    from ray.exceptions import ActorUnavailableError

    from actord.cluster.client import ClusterClient
    from actord.vocabulary.errors import NodeUnavailable

    class Away:  # a router handle whose every call finds the actor restarting
        def __getattr__(self, name: str) -> "Away":
            return self

        def remote(self, *args: object) -> None:
            raise ActorUnavailableError("restarting", None)

    c = ClusterClient(router=Away(), restart_wait_s=0.3)
    with pytest.raises(NodeUnavailable) as e:
        c.status()
    assert e.value.data["router"] is True
