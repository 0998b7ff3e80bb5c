"""Which slot a request that names none runs in, which idle slots n choices fork into, and
the room a page or file moved into a slot holds.

Why apart from the façade: both are choices over the slots' reported state (`Info`), below
the façade and above the slots; a mind's requests are placed by the mind placer actor
instead (actord/serving/placer.py). Both pass over the slots a request in flight is already
bound for (service/inflight.py), with no await between the choice and its record, so
two concurrent placements cannot pick the same slot.
"""

from __future__ import annotations

from typing import Any

import anyio

from actord.engine.jobs import ModelProps
from actord.vocabulary.errors import ActordError, ContextFull, NoFreeSlot
from actord.service.inflight import InFlight
from actord.vocabulary.log import get
from actord.vocabulary.types import CompletionRequest, SlotInfo
from actord.serving.messages import Fork, Info, MakeRoom, ReleaseRoom
from actord.serving.room import holding_room
from actord.serving.scheduler import Scheduler
from actord.serving.kv_index import KvIndex
from actord.serving.slot import Slot, gene_set

log = get("actord.service.placement")


class Placement:
    """The façade's slot moves outside the placer: it is given the slots and the scheduler
    the system built, the index their sequences are published in, the requests in flight
    (InFlight), the model's props and the system's default genes."""

    def __init__(self, slots: list[Slot], scheduler: Scheduler, index: KvIndex, inflight: InFlight,
                 props: ModelProps, ask_timeout_s: float, default_genes: list[int]) -> None:
        self.slots = slots
        self.scheduler = scheduler
        self.index = index
        self.default_genes = default_genes  # the system's (a shared list, filled at start)
        self.inflight = inflight
        self.props = props
        self.ask_timeout_s = ask_timeout_s

    async def place(self, request: CompletionRequest) -> Slot:
        """The idle slot whose tokens share the longest prefix with the request's prompt under its
        lineage (vocabulary/kv_identity.py: another gene set's or scope's cells are no prefix of it),
        else least deferred."""
        prompt = request.prompt
        slots = self.slots
        infos: list[SlotInfo] = [await s.ask(Info()) for s in slots]
        bound_for = self.inflight.bound()  # read after the last await: the caller records its choice at once
        idle = [i for i in infos if i.state == "idle" and i.deferred == 0 and i.id not in bound_for]
        # A mind's resident state is not written over while another idle slot can serve: an
        # unnamed request would cost the mind its cache (its next turn would prefill again).
        idle = [i for i in idle if i.mind is None] or idle
        if isinstance(prompt, list) and idle:
            lineage = (gene_set(self.default_genes, request), request.kv_scope())

            def held(i: SlotInfo) -> int:
                return self.index.prefix_held(i.id, prompt, lineage)

            best = max(idle, key=lambda i: (held(i), -i.n_tokens))
            return slots[best.id]
        if idle:
            return slots[min(idle, key=lambda i: i.n_tokens).id]
        if not infos:
            raise NoFreeSlot("no slots")
        return slots[min(infos, key=lambda i: i.deferred).id]


    async def fork_prefix(self, source: int, prefix: list[int], want: int) -> list[int]:
        """Up to `want` idle slots made to hold `source`'s prefix (actord/chat/choices.py's
        docstring: a fork is made only where cells free now hold it, evicting nobody)."""
        if want <= 0 or not prefix:
            return []
        if self.props.spec_rollback == "rs":
            # A copied sequence does not carry libllama's recurrent-state snapshots (n_rs_seq) in
            # a form the next verify's rollback can use: a fork's first rejected draft rolled
            # back to a wrong state (choices diverged at their second token). The choices queue
            # on the source slot instead, each from the shared prefill.
            log.debug("choices.no_fork", why="recurrent rollback snapshots are not copied")
            return []
        slots, scheduler = self.slots, self.scheduler
        infos = [await s.ask(Info()) for s in slots]
        bound = self.inflight.bound()
        idle = sorted((i for i in infos if i.state == "idle" and i.deferred == 0 and i.id not in bound and i.id != source),
                      key=lambda i: (i.mind is not None, i.n_tokens, i.id))
        targets = [i.id for i in idle[:want]]
        held = self.inflight.hold([source, *targets])  # no await since the choice: placements pass them by
        forks: list[int] = []
        try:
            for t in targets:
                room = await scheduler.ask(MakeRoom(slot=t, cells=len(prefix), evict=False))
                try:
                    if room.cells < len(prefix):
                        log.info("choices.no_room_to_fork", slot=t, n_tokens=len(prefix))
                        continue
                    if await slots[t].ask(Fork(src=source, tokens=prefix)):
                        forks.append(t)
                finally:
                    if room.token:  # the slot's own Cells tell holds them now
                        with anyio.CancelScope(shield=True), anyio.move_on_after(self.ask_timeout_s):
                            try:
                                await scheduler.ask(ReleaseRoom(token=room.token))
                            except ActordError:
                                pass  # stopping
        finally:
            self.inflight.release(held)
        return forks


    async def with_room(self, slot: int, n: int, msg: Any, **what: str) -> dict[str, Any]:
        """`msg` (a page-in or a restore of `n` tokens) asked of `slot` with KV cells for it held,
        from idle slots if need be, until the move is over however it ends: the steps in flight
        are never counted against cells it takes, and a refused move leaves no count behind."""
        async with holding_room(self.scheduler, slot, n, release_timeout=self.ask_timeout_s) as room:
            if room.cells < n:
                kind, name = next(iter(what.items()))
                raise ContextFull(f"no KV cells for {kind} {name!r} now: it needs {n}, the shared cache "
                                  f"(n_ctx {self.props.n_ctx}) has {room.cells} free for slot {slot}",
                                  **what, slot=slot, n_tokens=n, free=room.cells)
            return await self.slots[slot].ask(msg)
