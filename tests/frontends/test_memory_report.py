"""`actord stats memory` and `actord_memory_bytes{component}` on a daemon that has served
traffic (issue 26 item 2): every part named, none negative, the parts plus what is left
over make the RSS the kernel reports, and the parts that held bytes say so."""

from __future__ import annotations

import json

import httpx
import pytest

from actord import cli
from actord.frontends.client import Client
from actord.service.memory import COMPONENTS, mallinfo, read_smaps
from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama
from tests.frontends.daemons import Daemon


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A daemon with the HTTP front that served completions, a page out, chats and stored
    responses; yields (daemon, the report `actord stats memory` printed, the metrics text)."""
    tmp = tmp_path_factory.mktemp("mem")
    model = str(write_tiny_llama(tmp / "tiny.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE))
    d = Daemon(model, tmp, "--http", "127.0.0.1:0", "--memory-report-s", "0.2")
    try:
        with Client(str(d.sock), timeout=60) as c:
            url = "http://" + c.call("props")["http"]
            for i in range(6):
                c.call("completion", {"prompt": [1, *range(5, 120)], "n_predict": 4, "slot": i % 2})
            c.call("page.out", {"slot": 0, "page": "kept"})
            with httpx.Client(base_url=url, timeout=60) as h:
                for i in range(3):
                    assert h.post("/v1/chat/completions", json={
                        "model": "m", "user": "ada", "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"hello {i}"}]}).status_code == 200
                    assert h.post("/v1/responses", json={"model": "m", "input": f"hi {i}",
                                                         "max_output_tokens": 3}).status_code == 200
            yield d, c

    finally:
        d.proc.kill()
        d.proc.wait(30)


def test_stats_memory_names_every_part_and_sums_to_the_rss(served, capsys):
    d, _ = served
    assert cli.main(["--socket", str(d.sock), "stats", "memory"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert list(r["components"]) == list(COMPONENTS)
    assert all(v >= 0 for v in r["components"].values()), r
    assert r["accounted"] == sum(r["components"].values())
    assert r["accounted"] + r["unaccounted"] == r["rss"] > 0
    # What this traffic left behind, each in its own part.
    parts = r["components"]
    for name in ("page_store", "chat_turn_memory", "stored_responses", "trace_ring", "libllama_kv",
                 "libllama_model", "code", "python_heap"):
        assert parts[name] > 0, (name, r)
    assert r["python_heap_method"] == "malloc_in_use"


def test_the_gauges_carry_each_part_rss_and_unaccounted(served):
    _, c = served
    text = c.call("metrics")["text"]
    for name in (*COMPONENTS, "rss", "unaccounted"):
        assert f'actord_memory_bytes{{component="{name}"}}' in text, name


def test_stats_page_and_checkpoint_are_those_actors_counters(served):
    _, c = served
    assert c.call("stats", {"what": "page"}) == c.call("page.stats")
    assert set(c.call("stats", {"what": "checkpoint"})) == set(c.call("checkpoint.stats"))


def test_an_unknown_stats_part_is_a_typed_refusal(served):
    from actord.vocabulary.errors import ActordError

    _, c = served
    with pytest.raises(ActordError) as e:
        c.call("stats", {"what": "everything"})
    assert e.value.type == "InvalidParams" or e.value.code == -32602


def test_smaps_and_mallinfo_read_this_process():
    s = read_smaps(set())
    assert s.rss > 0 and s.rss == s.anon + s.files + s.model and s.model == 0
    m = mallinfo()
    assert m == {} or (m["in_use"] > 0 and m["free"] >= 0)
