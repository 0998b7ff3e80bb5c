"""What each client holds of the HTTP front's generations: counted by client address and,
with several API keys, by key too (issue 33: no client's flood denies another).

Why per key as well as per address: clients behind one proxy (or a NAT) share an address,
and one key's holder may come from many addresses; a flood under one key must leave the
other keys their share. With one key (or none) the key is everyone's: a bound on it would
be a front-wide cap, which `http_max_connections` already is, so keys are not counted then.

Two things are counted (the connections themselves are counted in bounds.py `Gate`):

- generations in flight, running or queued for a slot: one more than the address's (or
  the key's) share is refused 429 before it queues;
- chunks queued for streams, generated but not yet taken by their clients' transports:
  past the address's (or the key's) share, the stream whose chunk overflows ends, its
  generation cancelled, so clients that do not read hold neither memory nor engine time.

A generation past its share is refused twice over: from the request head, before its body
is read (`HttpFront.guard`, `generates=True`: the address, the key and the route are all
known then, so a flood of refused requests costs no body read nor parse), and again as it
starts (`streaming.Generation`), which is the count that holds: between the two, other
generations of the same client may have started. Either 429 is sent REFUSED_PAUSE_S after
it is decided (`paced`): a client that asks again the moment its 429 arrives, whatever
Retry-After said, gets its answers at that pace, not at its own. Why: each refusal costs
the loop little (about 165 us), but a flood of them did not stop: one key's flood on 16
connections, refused some 1,200 times a second with the loop a third busy, took a victim's
p90 from 12 to 250 ms, and on a loaded machine the flooding client's own CPU came out of
the daemon's. Paced, each of the flood's connections costs at most 1 / REFUSED_PAUSE_S
refusals a second and its client waits instead of spinning.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import anyio

REFUSED_PAUSE_S = 0.25  # a share's 429 leaves this long after it is decided (`paced`)


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
    """The client address a request's generations count against."""
    return str((scope.get("client") or ("?",))[0])


@dataclass
class Shares:
    generations_per_peer: int
    generations_per_key: int
    queued_per_peer: int
    queued_per_key: int
    generations: collections.Counter[str] = field(default_factory=collections.Counter)  # by address
    key_generations: collections.Counter[str] = field(default_factory=collections.Counter)
    queued: collections.Counter[str] = field(default_factory=collections.Counter)  # chunks, by address
    key_queued: collections.Counter[str] = field(default_factory=collections.Counter)

    def refusal(self, peer: str, key: str | None) -> tuple[str, str] | None:
        """Why one more generation from `peer` under `key` is refused (the message, the
        refusal's metric reason), or None: it may run."""
        if self.generations[peer] >= self.generations_per_peer:
            return (f"this client address has {self.generations_per_peer} generations in flight, the most it may "
                    "(http_max_generations_per_peer)", "peer_generations")
        if key is not None and self.key_generations[key] >= self.generations_per_key:
            return (f"this API key has {self.generations_per_key} generations in flight, the most it may "
                    "(http_max_generations_per_key)", "key_generations")
        return None

    def start(self, peer: str, key: str | None) -> None:
        self.generations[peer] += 1
        if key is not None:
            self.key_generations[key] += 1

    def end(self, peer: str, key: str | None) -> None:
        _drop(self.generations, peer, 1)
        if key is not None:
            _drop(self.key_generations, key, 1)

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


def _drop(counts: collections.Counter[str], name: str, n: int) -> None:
    left = counts[name] - n
    if left > 0:
        counts[name] = left
    else:
        counts.pop(name, None)
