"""The node's mind placer: actord's MindPlacer with the two verbs a migration needs.

Both run in the placer's own mailbox, so they are ordered with placements: no placement can
move the mind between finding it and saving or dropping it.

- `PersistMind(mind, drop)`: make the mind's state durable in its page file (`MIND.page`):
  from its slot (save), from its page in RAM (spill), or already there. With `drop`, the
  slot is erased and the RAM page freed afterwards.
- `ForgetMind(mind)`: erase its slot and drop its RAM page (the node no longer owns it, or
  is about to take a newer copy from a page file). Files are the node's to remove.
"""

from __future__ import annotations

from typing import Any

from actord.serving.kernel import Envelope
from actord.serving.messages import Erase, Info, Msg, SaveSlot
from actord.serving.page_store import DropPage, ListPages
from actord.serving.placer import MindPlacer, PlacerInbox, mind_file
from actord.vocabulary.errors import PageNotFound
from actord.vocabulary.log import get

log = get("actord.cluster.placer")


class PersistMind(Msg):
    mind: str
    drop: bool = False


class ForgetMind(Msg):
    mind: str


class ClusterPlacer(MindPlacer):
    async def handle(self, msg: Any, env: Envelope[Any]) -> None:
        match msg:
            case PersistMind(mind=mind, drop=drop):
                out = await self._persist(mind, drop)
            case ForgetMind(mind=mind):
                out = await self._forget(mind)
            case _:
                await super().handle(msg, env)
                return
        if env.reply is not None:
            env.reply.send(out)

    async def _slot_of(self, mind: str) -> int | None:
        for slot, held in self.slot_mind.items():
            if held == mind:
                if (await self.slots[slot].ask(Info())).mind == mind:
                    return slot
                self.slot_mind[slot] = None  # moved meanwhile (paged out by name)
                self.paged.append(mind)
        return None

    async def _persist(self, mind: str, drop: bool) -> dict[str, Any]:
        where = "none"
        slot = await self._slot_of(mind)
        if slot is not None:
            await self.slots[slot].ask(SaveSlot(file=mind_file(mind)))
            where = "slot"
            if drop:
                await self.slots[slot].ask(Erase())
                self.slot_mind[slot] = None
        elif mind in {p.page for p in await self.pages.ask(ListPages())}:
            await self.spill(mind, mind_file(mind), drop)
            where = "page"
        elif await self.files.exists(mind_file(mind)):
            where = "file"
        if drop:
            self.paged = [m for m in self.paged if m != mind]
        log.info("cluster.mind_persisted", mind=mind, where=where, drop=drop)
        return {"mind": mind, "where": where}

    async def _forget(self, mind: str) -> dict[str, Any]:
        slot = await self._slot_of(mind)
        if slot is not None:
            await self.slots[slot].ask(Erase())
            self.slot_mind[slot] = None
        page = False
        try:
            await self.pages.ask(DropPage(name=mind))
            page = True
        except PageNotFound:
            pass
        self.paged = [m for m in self.paged if m != mind]
        return {"mind": mind, "slot": slot, "page": page}


__all__ = ["ClusterPlacer", "ForgetMind", "PersistMind", "PlacerInbox"]
