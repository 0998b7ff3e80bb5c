"""Fuzzing the daemon in the suite (a few seconds; `bench/fuzz.py` runs a million inputs).

Three hypothesis tests against one daemon: every method's params built from the method
table's own types (typed values or any JSON), raw bytes, and the shared fuzzer's
envelopes, batches and mutations (driven by hypothesis' randoms, so failures shrink to a
seed). Every answer must be well-formed JSON-RPC with a typed error; afterwards the daemon
must be alive, serve a completion and have logged no traceback.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actord.frontends.rpc.methods import METHODS
from actord.testing.fuzz import STOPS
from actord.testing.fuzz import Conn, Fuzzer, Report, problems_in, run_round
from tests.frontends.daemons import Daemon

pytestmark = pytest.mark.slow  # thousands of fuzzed requests against a daemon

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def strategy_for(t: Any) -> st.SearchStrategy:
    """Values of an inspected msgspec type, or now and then any JSON at all."""
    I = msgspec.inspect
    if isinstance(t, I.IntType):
        typed: st.SearchStrategy = st.integers(min_value=-2**65, max_value=2**65) | st.integers(0, 4)
    elif isinstance(t, I.FloatType):
        typed = st.floats(allow_nan=False, allow_infinity=False)
    elif isinstance(t, I.StrType):
        typed = st.text(max_size=40) | st.sampled_from(["/dev/zero", "../x", "d/" * 30 + "x", "a\x00b", "ada"])
    elif isinstance(t, I.BoolType):
        typed = st.booleans()
    elif isinstance(t, I.NoneType):
        typed = st.none()
    elif isinstance(t, I.UnionType):
        typed = st.one_of([strategy_for(x) for x in t.types])
    elif isinstance(t, I.ListType):
        typed = st.lists(strategy_for(t.item_type), max_size=6)
    elif isinstance(t, I.StructType):
        typed = params_for(t)
    else:
        typed = json_values
    return st.one_of(typed, typed, typed, json_values)


def params_for(ti: Any) -> st.SearchStrategy:
    required = {f.name: strategy_for(f.type) for f in ti.fields if f.required}
    optional = {f.name: strategy_for(f.type) for f in ti.fields if not f.required}
    return st.fixed_dictionaries(required, optional=optional)


@st.composite
def table_requests(draw: Any) -> bytes:
    name = draw(st.sampled_from(sorted(m for m in METHODS if m not in STOPS)))
    params = draw(params_for(msgspec.inspect.type_info(METHODS[name].params)))
    if name == "completion" and isinstance(params.get("n_predict"), int):
        params["n_predict"] = params["n_predict"] % 8  # fuzz the checks, not the model's speed
    rid = draw(st.integers(1, 10**6) | st.text(max_size=5) | st.none())
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": name, "params": params}).encode()


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("fuzz")
    d = Daemon(tiny_model, folder, "--max-line-bytes", "65536", ctx=512)
    conn = Conn(str(d.sock), timeout=30)
    conn.open()
    yield d, conn
    conn.close()
    assert d.proc.poll() is None, "the daemon died"
    with d.client() as c:
        assert len(c.complete([1, 2, 3], n_predict=4, ignore_eos=True)["tokens"]) == 4
    assert d.stop() == 0
    d.assert_clean_log()


def _exchange(conn: Conn, line: bytes) -> None:
    """Send one line and a sentinel; every answer up to the sentinel must be well-formed."""
    assert conn.sock is not None
    conn.sock.sendall(line.replace(b"\n", b" ") + b'\n{"jsonrpc":"2.0","id":"sentinel","method":"health"}\n')
    for got in conn.lines():
        problems, ids = problems_in(got)
        assert not problems, (line[:300], got[:300], problems)
        if "sentinel" in ids:
            return


@FUZZ
@given(line=table_requests())
def test_fuzz_every_method_with_params_from_the_method_table(fuzz_daemon, line):
    _, conn = fuzz_daemon
    _exchange(conn, line)


@FUZZ
@given(data=st.binary(max_size=200))
def test_fuzz_raw_bytes(fuzz_daemon, data):
    _, conn = fuzz_daemon
    _exchange(conn, data)


@FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_fuzz_envelopes_batches_and_mutations(fuzz_daemon, rng):
    _, conn = fuzz_daemon
    report = Report()
    run_round(conn, Fuzzer(rng.randrange(2**32), max_line=65536), 16, report, "round")
    assert not report.problems, report.problems[:5]


def test_the_fuzz_connection_was_never_dropped(fuzz_daemon):
    d, conn = fuzz_daemon
    assert d.metric('rpc_disconnects_total{reason="outbox_overflow"}') == 0
    assert isinstance(conn.sock, socket.socket)
