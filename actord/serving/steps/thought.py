"""A reasoning budget's watch over one request's output, token by token (the core's part of
actord.chat.reasoning's budget).

Why here, in the per-token core: cutting a thought must happen between two samples, where
only the scheduling core stands. The chat layer decides the policy (which tokens open and
close a thought in this template family, what is forced, whether the prompt already opened
one) and hands it down as a `ThoughtBudget`; this watch only counts. Its semantics follow
llama.cpp's reasoning-budget sampler (common/reasoning-budget.cpp), read, not copied:

- a thought starts after the start marker's tokens in the output, or at once when the
  prompt left the model inside one (`opened`); it ends at the end marker's tokens;
- every generated token of a thought that does not complete the end marker counts; once
  `budget` have, the thought is forced closed: the forced tokens (the budget message's,
  then the end marker's) follow as if generated, and sampling goes on after them;
- a counted-out token that leaves a UTF-8 character unfinished is let finish first (the
  next tokens, still sampled, until one ends a character), so the thought is never cut
  inside a character;
- after a thought ends, naturally or forced, a new start marker opens a new budget.

The core asks `step` after each output token and, to keep the overlap honest, `limit`: how
far the output may reach before the forcing could be due, so no sample is planned blind
past it (the core's `feed_until`).
"""

from __future__ import annotations

from typing import Protocol

from actord.vocabulary.types import ThoughtBudget, TokenLogprob
from actord.serving.steps.text import TextState, ends_whole


class Fed(Protocol):
    """What a forcing writes into: a request's tokens and output (records.py `Request`)."""

    tokens: list[int]
    out: list[int]
    logprobs: list[TokenLogprob] | None
    text: TextState | None


_WAIT, _COUNT, _FINISH = 0, 1, 2  # before a thought, inside one, a counted-out character finishing


def _advance(seq: list[int], matched: int, tok: int) -> int:
    """How much of `seq` the output's end matches after `tok`, given `matched` before it
    (the markers are a few tokens: the naive fallback is cheap)."""
    if matched < len(seq) and seq[matched] == tok:
        return matched + 1
    have = seq[:matched] + [tok]
    for k in range(min(matched, len(seq) - 1), 0, -1):
        if have[-k:] == seq[:k]:
            return k
    return 0


class Thought:
    """One request's budget watch (see the module docstring)."""

    __slots__ = ("b", "state", "count", "start_at", "end_at")

    def __init__(self, b: ThoughtBudget) -> None:
        self.b = b
        self.state = _COUNT if b.opened else _WAIT
        self.count = 0  # tokens of the current thought
        self.start_at = 0  # how much of the start marker the output's end matches
        self.end_at = 0  # how much of the end marker

    def step(self, tok: int, piece: bytes) -> bool:
        """Watch one output token; True when the thought must be forced closed now."""
        if self.state == _WAIT:
            start = self.b.start
            if start:
                self.start_at = _advance(start, self.start_at, tok)
                if self.start_at == len(start):
                    self.state, self.count, self.start_at, self.end_at = _COUNT, 0, 0, 0
            return False
        self.end_at = _advance(self.b.end, self.end_at, tok)
        if self.end_at == len(self.b.end):  # the model closed its thought itself
            self.state, self.end_at = _WAIT, 0
            return False
        if self.state == _COUNT:
            self.count += 1
            if self.count < self.b.budget:
                return False
            self.state = _FINISH
        return self._due(piece)

    def _due(self, piece: bytes) -> bool:
        if not ends_whole(piece):
            return False
        self.state, self.end_at = _WAIT, 0  # forced now; a new start marker opens a new budget
        return True

    def force(self, r: Fed, room: int) -> tuple[str, bool]:
        """Put the first `room` forced tokens into `r`'s output as if generated (the next
        entry feeds them); (their text streamable now, whether a stop string hit in it)."""
        out, text, deltas = r.out, r.text, []
        assert text is not None
        for tok, piece in zip(self.b.forced[:max(0, room)], self.b.pieces):
            r.tokens.append(tok)
            out.append(tok)
            if r.logprobs is not None:  # forced: certain, no alternative weighed
                r.logprobs.append(TokenLogprob(token=tok, text=piece.decode(errors="replace"), bytes=list(piece),
                                               logprob=0.0))
            delta, stopped = text.push(piece)
            deltas.append(delta)
            if stopped:
                return "".join(deltas), True
        return "".join(deltas), False

    def limit(self, n_out: int) -> int:
        """The most output tokens there can be before a forcing is due (what samples in flight
        may reach): the output now, then the start marker's rest and a whole budget, or the
        budget's rest, or one token (a character finishing)."""
        if self.state == _WAIT:
            return n_out + len(self.b.start) - self.start_at + self.b.budget if self.b.start else 1 << 62
        if self.state == _COUNT:
            return n_out + self.b.budget - self.count
        return n_out + 1
