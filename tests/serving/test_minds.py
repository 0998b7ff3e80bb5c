"""Minds named by requests are placed by the daemon: page out, spill, page in, restore."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio


async def test_more_minds_than_slots_resume_with_only_their_suffix(tiny_model, tmp_path):
    cfg = Config(model=tiny_model, slots=2, ctx=1024, batch=64, page_dir=str(tmp_path), page_ram_bytes=12_000)
    history = {f"m{i}": [1, 10 + i, 20 + i, 30 + i, 40 + i, 50 + i, 60 + i, 70 + i] for i in range(4)}
    seen: list[tuple[list[int], list[int]]] = []
    async with ActorSystem(cfg) as s:
        for rnd in range(3):
            for mind, prompt in history.items():
                r = await s.complete(prompt=prompt, n_predict=6, mind=mind, ignore_eos=True)
                if rnd > 0:  # displaced since its last turn, yet only the new suffix is decoded
                    assert r.n_prompt_processed == 3, (mind, rnd, r)
                seen.append((list(prompt), r.tokens))
                history[mind] = prompt + r.tokens + [5, 6]
        m = s.metrics.snapshot()
        assert m["page_out_total"] > 0 and m["page_in_total"] > 0 and m["page_spill_total"] > 0
        assert {i.mind for i in await s.slot_list()} <= set(history)
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=1024, batch=64)) as ref:
        for prompt, tokens in seen:  # a slot that never moved gives the same tokens
            assert (await ref.complete(prompt=prompt, n_predict=6, slot=0, ignore_eos=True)).tokens == tokens
            await ref.slot_erase(0)
