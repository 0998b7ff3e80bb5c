"""The seeded simulation's persistence checks (issue 34), apart from sim.py so that both fit.

After a graceful stop with no fault fired, every mind a slot or a RAM page holds must read
back from her page file with exactly her tokens; then a second system over the same page
folder (a restart) must bring each of them back at her next turn processing only what her
file does not hold. Each check answers a problem's description, or None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec

from actord.vocabulary.config import Config
from actord.vocabulary.errors import ActordError
from actord.storage.osfs import OsFs
from actord.storage.publish import read_generation
from actord.vocabulary.names import is_cache_mind

Held = dict[str, list[tuple[tuple[int, ...], tuple[Any, ...]]]]


def held_by(system: Any) -> Held:
    """Mind name -> (tokens, genes) of each holder: slots with a mind, current RAM pages (a
    name a slot and a page both hold, after `page.out` under a restored mind's name, has two);
    the prompt cache's minds are not kept past a stop, so not held here."""
    held: Held = {}
    for sl in system.slots:
        if sl.mind is not None and sl.kv_tokens and not is_cache_mind(sl.mind):
            held.setdefault(sl.mind, []).append((tuple(sl.kv_tokens), tuple(sl.genes)))
    for g in system.pages.gens.values():
        if (g.page is not None and g.page.name and system.pages.names.get(g.page.name) == g.page.gen
                and not is_cache_mind(g.page.name)):
            held.setdefault(g.page.name, []).append((tuple(g.page.tokens), tuple(g.page.genes)))
    return held


def persisted_problem(root: Path, held: Held) -> str | None:
    for mind, states in held.items():
        try:
            image = read_generation(root, f"{mind}.page", OsFs())
        except ActordError as e:
            return f"after a graceful stop, {mind!r} has no page file: {e.type}"
        if tuple(image.tokens) not in {t for t, _ in states}:
            return f"after a graceful stop, {mind}.page holds other tokens than the mind"
    return None


async def restart_problem(disp: Any, cfg: Config, histories: dict[str, list[int]], held: Held,
                          drive: Callable[[Awaitable[Any]], Awaitable[Any]]) -> str | None:
    """The restart: minds held with no genes (the new process has loaded none) and by one
    holder each; `drive` runs one call to its end under the deterministic dispatcher. A
    mind whose next prompt parts from her file before its end is held to the bound only
    where the memory can be cut back anywhere (SWA and recurrent memory resume from a
    checkpoint, which the seeded budget may not keep, exactly as without a restart)."""
    from actord.service.system import ActorSystem
    from actord.policy.prefix_index import common_prefix

    system = ActorSystem(msgspec.structs.replace(cfg, device_bytes=0), dispatcher=disp)
    problem = None
    async with system:
        disp.live = True
        left = [n for n in system.files.index.files if is_cache_mind(n)]
        if left:  # the prompt cache's minds end with the process that made them
            problem = f"after a restart, the prompt cache's files {left[:3]} are still in the page folder"
            histories = {}
        for mind, prompt in sorted(histories.items()):
            states = [t for t, genes in held.get(mind, []) if not genes]
            if len(states) != 1 or len(held[mind]) != 1:
                continue
            got = await drive(system.complete(prompt=prompt, n_predict=1, mind=mind, ignore_eos=True))
            lcp = common_prefix(list(states[0]), prompt)
            cuts_back = not system.props.needs_checkpoints and not system.props.n_swa
            if lcp < len(states[0]) and not cuts_back:
                continue  # SWA or recurrent memory resumes mid-sequence from a checkpoint, if one is kept
            if got.n_prompt_processed > len(prompt) - lcp + 1:
                problem = (f"after a restart, {mind} processed {got.n_prompt_processed} of {len(prompt)} prompt "
                           f"tokens, her file holding {lcp} of them")
                break
        while await disp.step():  # what runs in the background (the base files' sweep) ends
            pass
        disp.close_actors()
    return problem
