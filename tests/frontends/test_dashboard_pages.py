"""The dashboard's data route pages its minds by name (issue 34: 10,000 minds): `?after=&limit=`
answers a page of them and the cursor of the next; a bad limit is a 400 before any work."""

from __future__ import annotations

import httpx
import pytest

from actord.frontends.http.app import HttpFront
from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

KEY = "pages-key"
pytestmark = pytest.mark.anyio


async def test_the_dashboard_state_answers_a_page_of_minds_and_the_next_cursor(tiny_model, tmp_path):
    cfg = Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path), api_key=KEY)
    async with ActorSystem(cfg) as s:
        for i in range(3):
            await s.complete(prompt=[1, 2, 3, 10 + i], n_predict=1, slot=0, ignore_eos=True)
            await s.page_out(0, f"m{i}")
        front = HttpFront(None, cfg)
        front.attach(s)
        auth = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front.app), base_url="http://front") as c:
            first = (await c.get("/dashboard/state?limit=2", headers=auth)).json()
            assert [m["name"] for m in first["minds"]] == ["m0", "m1"] and first["next"] == "m1"
            rest = (await c.get(f"/dashboard/state?after={first['next']}&limit=2", headers=auth)).json()
            assert [m["name"] for m in rest["minds"]] == ["m2"] and rest["next"] is None
            assert (await c.get("/dashboard/state?limit=-1", headers=auth)).status_code == 400
            whole = (await c.get("/dashboard/state", headers=auth)).json()  # no page asked: every mind
            assert [m["name"] for m in whole["minds"]] == ["m0", "m1", "m2"]
