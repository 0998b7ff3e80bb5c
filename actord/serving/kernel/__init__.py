"""A small actor kernel: typed bounded mailboxes, tell/ask, supervision, one dispatch seam.

Prior art: pykka (tell and ask kept apart, an envelope carrying the reply channel, pending
asks failing when an actor stops) and anyio's memory object streams (bounded: backpressure
is a feature). What we leave out: unbounded inboxes, untyped receive, a global registry.

Messages are msgspec Structs and pure data. The reply channel (and a streaming sink) travel
beside the message in an `Envelope`, never inside it, so every delivery can be encoded into
a trace (`mailbox.py`). Every delivery goes through the `Dispatcher` (`dispatcher.py`): it is
the single seam through which a deterministic, recording dispatcher can take over the order
of deliveries. Actors do not start tasks themselves.

Asks flow one way. Actors have ranks: the mind placer (10) above the scheduler (20) above
the slots (30) above the page store, the checkpoint budget and the gene residency (40),
which sit above the engine thread and the storage workers (not actors). An actor may await
a reply only from an actor of a strictly greater rank; upward it tells, and the upper actor
acts on its own turn. `ask` refuses an upward or sideways ask at once (`AskOrderViolated`),
so the order holds by construction, not by review. Clients (RPC connections, host calls)
are not actors and may ask anyone.

What the order cannot see, the wait-for graph does: the dispatcher records who is awaiting
whom (an ask's reply, or room in a full mailbox) and refuses the wait that would close a
cycle (`AskCycle`, with the chain), the moment it would close. Every ask also has a bound:
past it the asker gets `AskTimeout` with the wait-for chain, logged, never a silent hang.

The two lanes of a mailbox, the order of delivery and supervision are the `Actor`'s
(`actor.py`).

    mailbox.py     Reply (a one-shot reply channel) and Envelope (a message and its reply channel)
    dispatcher.py  Dispatcher: the tasks that run actor loops, the hooks, the wait-for graph
    actor.py       Actor: the two lanes, delivery order, tell/ask, supervision
"""

from actord.serving.kernel.actor import CURRENT, Actor, ActorStats
from actord.serving.kernel.dispatcher import Dispatcher
from actord.serving.kernel.mailbox import Envelope, Reply, StreamSink

__all__ = ["CURRENT", "Actor", "ActorStats", "Dispatcher", "Envelope", "Reply", "StreamSink"]
