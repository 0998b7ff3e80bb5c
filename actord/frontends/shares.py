"""What each client holds of the daemon's generations, one count for both fronts: an HTTP
client by its address and, with several API keys, by key too; a socket client by its
process (`socket_peer`) (issue 33: no client's flood denies another).

Why per key as well as per address: clients behind one proxy (or a NAT) share an address,
and one key's holder may come from many addresses; a flood under one key must leave the
other keys their share. With one key (or none) the key is everyone's: a bound on it would
be a front-wide cap, which `http_max_connections` already is, so keys are not counted then.

Three things are counted (the connections themselves are counted in bounds.py `Gate`):

- generations in flight, running or queued for a slot: an address (or a key) holds at most
  its share of them. An address's share is its configured one (twice the slots by
  default) while it is the only active client, else its fair part of the slots (the
  slots over the active clients, rounded up; `peer_share`). The active clients are the
  addresses and the socket's client processes at work, all counted here. Why: one
  address's load tool at its whole share holds every slot, so another client's one
  request waited behind its generations, again and again
  (bench/abuse.py `per_address`: a victim's p90 from 17 ms to 5.4 s); with fair parts
  the tool gives slots up as its generations end, and takes them all again once the
  others have been quiet for ACTIVE_LINGER_S;
- generations waiting for their client's share, one line for both fronts: past the share, a
  generation waits its turn (`enter`), its body unread, up to `waiting_per_peer` per
  address (and per key); one more is refused 429. Why wait rather than refuse: a load tool
  or an agent fleet sends from one address more requests at once than twice the slots
  (AIPerf at concurrency 16, llama.cpp's own tests 3 at once on 1 slot), and llama-server
  queues them; a 429 made each its client's error. Why a line at the front rather than the
  slots' queues: a waiting generation holds its connection alone (its head read, its
  body left in the socket), never a slot's queue, so one client's hundred waiting requests
  are never ahead of another's one: the other's starts at once, within its own share. A
  generation is let in when its client's share frees, oldest first;
- chunks queued for streams, generated but not yet taken by their clients' transports:
  past the address's (or the key's) share, the stream whose chunk overflows ends, its
  generation cancelled, so clients that do not read hold neither memory nor engine time.

A generation is counted from its request head (`HttpFront.guard`, `generates=True`: the
address, the key and the route are all known then, so a refused or waiting request costs
no body read nor parse) until its answer ends (`streaming.Generation`, handed the `Ticket`);
on the socket from its decoded request until its answer is sent (rpc/server.py), where a
client's line is bounded by the socket's own bounds (requests in flight per connection,
connections), not by waiting_per_peer. On the
socket a client is a process, as on HTTP it is an address: a load tool's 16 connections are
one client (else it would take 16 parts of the slots to another process's one), and two
agents are two.
A 429 is sent REFUSED_PAUSE_S after it is decided (`paced`): a client that asks again the
moment its 429 arrives, whatever Retry-After said, gets its answers at that pace, not at
its own. Why: each refusal costs the loop little (about 165 us), but a flood of them did
not stop: one key's flood on 16 connections, refused some 1,200 times a second with the
loop a third busy, took a victim's p90 from 12 to 250 ms, and on a loaded machine the
flooding client's own CPU came out of the daemon's. Paced, each of the flood's connections
costs at most 1 / REFUSED_PAUSE_S refusals a second and its client waits instead of spinning.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio

REFUSED_PAUSE_S = 0.25  # a share's 429 leaves this long after it is decided (`paced`)
ACTIVE_LINGER_S = 1.0  # an address stays active this long after its last generation ends (`peer_share`)


async def paced() -> None:
    """The wait before a share's 429 is sent (the module docstring says why); the request's
    connection holds nothing else meanwhile, and its client may go away."""
    await anyio.sleep(REFUSED_PAUSE_S)


def key_generations(configured: int, slots: int) -> int:
    """A key's share of generations in flight, with several keys: `configured`, else (0)
    all the slots but one. Why that default: a key holding every slot (the per-address
    default, twice the slots, let it) leaves the other keys queueing behind its flood; at
    one slot fewer, whatever one key floods, a slot stays free of its generations, while a
    key alone still uses all but one. (One slot: the key may hold it, else none could run.)"""
    return configured or max(1, slots - 1)


def peer_of(scope: Any) -> str:
    """The client address an HTTP request's generations count against."""
    return str((scope.get("client") or ("?",))[0])


def socket_peer(pid: int | None, connection: int) -> str:
    """The name a socket client's generations count under (never an address's): its process,
    from the connection's credentials, else (none known) the connection itself."""
    return f"socket:pid:{pid}" if pid is not None else f"socket:#{connection}"


@dataclass(eq=False)
class Ticket:
    """One generation counted against its address and key, until `release` (once)."""

    shares: Shares
    peer: str
    key: str | None
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.shares.end(self.peer, self.key)


@dataclass(eq=False)
class _Waiting:
    peer: str
    key: str | None
    let_in: anyio.Event = field(default_factory=anyio.Event)
    admitted: bool = False


@dataclass
class Shares:
    generations_per_peer: int
    generations_per_key: int
    queued_per_peer: int
    queued_per_key: int
    waiting_per_peer: int = 0  # generations waiting past the share, per address and per key
    generations: collections.Counter[str] = field(default_factory=collections.Counter)  # by address
    key_generations: collections.Counter[str] = field(default_factory=collections.Counter)
    waiting: collections.Counter[str] = field(default_factory=collections.Counter)  # by address
    key_waiting: collections.Counter[str] = field(default_factory=collections.Counter)
    queued: collections.Counter[str] = field(default_factory=collections.Counter)  # chunks, by address
    key_queued: collections.Counter[str] = field(default_factory=collections.Counter)
    line: collections.deque[_Waiting] = field(default_factory=collections.deque)  # oldest first
    # The daemon's slots: with them, an address's share is its fair part while others are
    # active (`peer_share`); 0: the configured share alone.
    slots: int = 0
    linger_s: float = ACTIVE_LINGER_S
    clock: Callable[[], float] = time.monotonic
    # Clients with nothing in flight nor waiting, by when their last generation ended:
    # active still, for linger_s (a client between two requests is not gone).
    ended: dict[str, float] = field(default_factory=dict)
    # Waiting, by (address, key): a client's generations go in their order, and only
    # behind its own (two keys behind one address do not wait for each other's shares).
    clients_waiting: collections.Counter[tuple[str, str | None]] = field(default_factory=collections.Counter)

    @classmethod
    def from_config(cls, config: Any) -> Shares:
        """The daemon's one count, from its Config (both fronts are given it)."""
        return cls(generations_per_peer=config.http_max_generations_per_peer or 2 * config.slots,
                   generations_per_key=key_generations(config.http_max_generations_per_key, config.slots),
                   queued_per_peer=config.http_max_queued_chunks_per_peer,
                   queued_per_key=config.http_max_queued_chunks_per_key or config.http_max_queued_chunks_per_peer,
                   waiting_per_peer=config.http_max_waiting_per_peer, slots=config.slots)

    def watch(self, metrics: Any) -> None:
        """The line's length is `generations_waiting`, read as it is scraped (both fronts
        call this as they attach: the line is this count's own)."""
        metrics.generations_waiting.set_function(lambda: len(self.line))

    def peer_share(self, peer: str, active: int | None = None) -> int:
        """The generations `peer` may have in flight now: its configured share while it is
        the only active address, else its fair part of the slots (rounded up), so that
        one address's load tool, whose share holds every slot, gives the slots up as its
        generations end while another address is served. Work-conserving: alone, an
        address has its whole share again once the others are quiet for linger_s.
        `active`: the active clients, counted once for a pass over the line."""
        if not self.slots:
            return self.generations_per_peer
        n = active if active is not None else self._active(peer)
        # Rounded up, so the parts cover every slot while every client is at work.
        return self.generations_per_peer if n <= 1 else min(self.generations_per_peer, -(-self.slots // n))

    def _active(self, peer: str | None = None) -> int:
        """Clients at work: those with generations in flight or waiting, or one ended within
        linger_s (and `peer`, about to ask)."""
        if self.ended:
            old = self.clock() - self.linger_s
            for a in [a for a, t in self.ended.items() if t < old]:
                del self.ended[a]
        names = set(self.generations) | set(self.waiting) | set(self.ended)
        if peer is not None:
            names.add(peer)
        return len(names)

    def refusal(self, peer: str, key: str | None, line: int | None = None) -> tuple[str, str] | None:
        """Why one more generation from `peer` under `key` may neither start nor wait (the
        message, the refusal's metric reason), or None. `line`: how many of the client's may
        wait (None: waiting_per_peer)."""
        share = self.peer_share(peer)
        if self.generations[peer] >= share and self.waiting[peer] >= (self.waiting_per_peer if line is None else line):
            return (f"this client ({peer}) has {self.generations[peer]} generations in flight (its share: {share}) "
                    f"and {self.waiting[peer]} waiting, the most it may (http_max_generations_per_peer, "
                    "http_max_waiting_per_peer)", "peer_generations")
        if key is not None and self.key_generations[key] >= self.generations_per_key \
                and self.key_waiting[key] >= self.waiting_per_peer:
            return (f"this API key has {self.generations_per_key} generations in flight and "
                    f"{self.key_waiting[key]} waiting, the most it may (http_max_generations_per_key, "
                    "http_max_waiting_per_peer)", "key_generations")
        return None

    def admit(self, peer: str, key: str | None) -> Ticket | None:
        """A generation from `peer` under `key` counted at once, if it is within its shares
        and none of its client's waits before it; else None (it waits, `wait_turn`, or is
        refused)."""
        self.ended.pop(peer, None)
        if self.clients_waiting[peer, key] or not self._fits(peer, key, self._active(peer)):
            return None
        self.start(peer, key)
        return Ticket(self, peer, key)

    async def enter(self, peer: str, key: str | None, line: int | None = None) -> Ticket | tuple[str, str]:
        """A generation from `peer` under `key` counted, at once within its shares, else once
        its turn in the line comes; the refusal (as `refusal`) when it may not even wait."""
        return self.admit(peer, key) or await self.wait_turn(peer, key, line)

    async def wait_turn(self, peer: str, key: str | None, line: int | None = None) -> Ticket | tuple[str, str]:
        """For a generation `admit` did not count: counted once its turn in the line comes;
        the refusal when it may not even wait. Cancelled while waiting, it leaves the line
        and holds nothing."""
        refused = self.refusal(peer, key, line)
        if refused is not None:
            return refused
        w = _Waiting(peer, key)
        self.line.append(w)
        self.waiting[peer] += 1
        self.clients_waiting[peer, key] += 1
        if key is not None:
            self.key_waiting[key] += 1
        # With fair parts, a share grows when another address goes quiet, which no end
        # tells: a waiter looks again every linger_s.
        every = self.linger_s if self.slots else math.inf
        try:
            while not w.admitted:
                with anyio.move_on_after(every):
                    await w.let_in.wait()
                if not w.admitted:
                    self._let_in()
        except BaseException:
            if w.admitted:  # let in as it was cancelled: what it was given goes to the next
                self.end(peer, key)
            else:  # those of its client behind it may fit now
                self.line.remove(w)
                self._unwait(w)
                self._let_in()
            raise
        return Ticket(self, peer, key)

    def start(self, peer: str, key: str | None) -> None:
        self.generations[peer] += 1
        if key is not None:
            self.key_generations[key] += 1

    def end(self, peer: str, key: str | None) -> None:
        _drop(self.generations, peer, 1)
        if key is not None:
            _drop(self.key_generations, key, 1)
        if not self.generations[peer] and not self.waiting[peer]:
            self.ended[peer] = self.clock()
        if self.line:
            self._let_in()

    def queue(self, peer: str, key: str | None) -> bool:
        """One chunk more queued for a stream of `peer` under `key`; False (nothing counted):
        past the address's or the key's share."""
        if self.queued[peer] >= self.queued_per_peer or (key is not None and self.key_queued[key] >= self.queued_per_key):
            return False
        self.queued[peer] += 1
        if key is not None:
            self.key_queued[key] += 1
        return True

    def taken(self, peer: str, key: str | None, n: int) -> None:
        """`n` of the stream's queued chunks were handed to its transport (or dropped)."""
        if n:
            _drop(self.queued, peer, n)
            if key is not None:
                _drop(self.key_queued, key, n)

    def _fits(self, peer: str, key: str | None, active: int) -> bool:
        return self.generations[peer] < self.peer_share(peer, active) and (
            key is None or self.key_generations[key] < self.generations_per_key)

    def _let_in(self) -> None:
        """Each waiting generation whose shares now fit, oldest first; one that does not fit
        keeps its client's later ones behind it."""
        blocked: set[tuple[str, str | None]] = set()
        kept: collections.deque[_Waiting] = collections.deque()
        active = self._active()  # every waiter's address is among them: one count for the pass
        for w in self.line:
            if (w.peer, w.key) in blocked or not self._fits(w.peer, w.key, active):
                blocked.add((w.peer, w.key))
                kept.append(w)
                continue
            self._unwait(w)
            self.start(w.peer, w.key)
            w.admitted = True
            w.let_in.set()
        self.line = kept

    def _unwait(self, w: _Waiting) -> None:
        _drop(self.waiting, w.peer, 1)
        _drop(self.clients_waiting, (w.peer, w.key), 1)
        if w.key is not None:
            _drop(self.key_waiting, w.key, 1)


def _drop(counts: collections.Counter[Any], name: Any, n: int) -> None:
    left = counts[name] - n
    if left > 0:
        counts[name] = left
    else:
        counts.pop(name, None)
