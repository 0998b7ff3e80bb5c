"""A slot's checkpoint plan: its mind's divergence history and the policy that reads it.

Why a separate object: the Slot actor owns a request's lifecycle; which checkpoints to make
and keep is policy (`actord.policy.checkpoint_placement`, or the original C++ server's
spacing-and-count rules for `--checkpoint-policy divergence|oldest`), fed by a little state
that travels with the mind: where its requests diverged (bounded, oldest first) and where
its last prompt ended. That state moves with the mind into its page and page file and back;
the slot only calls `observe`, `positions`, `keep` and `view` at the points where it already
handled checkpoints. Synchronous and engine-free, so it is easy to test and to reason about.
"""

from __future__ import annotations

from typing import Sequence

from actord.policy.checkpoint_records import CheckpointLike
from actord.policy.checkpoint_select import select_indices
from actord.vocabulary.config import CHECKPOINT_POLICIES as POLICIES
from actord.policy.checkpoint_placement import (
    HISTORY, Divergence, Forecast, forecast, keep_best, plan, remember, slot_count,
)

POPULATION = 32  # other minds' divergences a slot remembers (its prior for a new mind)


class CheckpointPlan:
    def __init__(self, policy: str = "placement", keep: int = 16, every: int = 512, share_bytes: int = 0,
                 align: int = 512, tile: int = 1) -> None:
        if policy not in POLICIES:
            raise ValueError(f"checkpoint policy is one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.keep = keep  # a list holds at most 1 + keep (the safety cap)
        self.every = every  # spacing, for the original C++ server's policies
        self.share_bytes = share_bytes  # this slot's share of the byte budget
        self.align = align  # the scheduler's chunk: grid checkpoints cost no extra decode
        self.tile = tile  # the scheduler ends pieces on multiples of this: so does the grid
        self.history: list[Divergence] = []
        self.prompt_end = 0  # length of the last prompt this mind's slot processed; 0 = unknown
        self.ckpt_bytes = 0  # size of the last checkpoint seen (they are about constant per model)
        self.last: list[int] = []  # the last plan, for display
        # Where the minds this slot served diverged (fractions of their prompts), whoever they
        # were: the prior for a mind whose own history does not say yet. Stays with the slot.
        self.population: list[float] = []

    @property
    def cap(self) -> int:
        return 1 + self.keep

    # -- the mind's state ----------------------------------------------------------------

    def reset(self) -> None:
        """The slot's mind is gone (erase, page out): nothing is known about the next one."""
        self.history, self.prompt_end, self.last = [], 0, []

    def adopt(self, history: Sequence[Divergence], prompt_end: int, n_tokens: int) -> None:
        """A mind arrives from a page or file; without a recorded prompt end (an older file)
        what it holds stands in."""
        self.history = list(history)[-HISTORY:]
        self.prompt_end = prompt_end or n_tokens
        self.last = []

    def observe(self, raw_lcp: int) -> None:
        """A request diverged at this raw lcp from what the slot held."""
        if self.prompt_end > 0:  # a slot that held nothing learns nothing
            self.history = remember(self.history, Divergence(lcp=raw_lcp, end=self.prompt_end))
            if raw_lcp < self.prompt_end - 1:  # not an append
                self.population = [*self.population, raw_lcp / self.prompt_end][-POPULATION:]

    def started(self, n_prompt: int) -> None:
        """The request's prompt (n_prompt tokens) is being processed."""
        self.prompt_end = n_prompt

    def wants_at_resume(self, m: int, have: Sequence[int]) -> bool:
        """The memory itself served a resume at m (no checkpoint): is a snapshot right there,
        before anything more is decoded, part of the best plan? (The scheduler can only cut
        a chunk after at least one token, so only the slot can take this one.)"""
        if self.policy != "placement" or m <= 0 or m in have:
            return False
        n = max(self.prompt_end, m + 1)
        return m in self._plan(n, [p for p in have if p < m], m - 1, n - 1)

    def _plan(self, n_prompt: int, have: Sequence[int], lo: int, hi: int) -> list[int]:
        """The placement's new positions, decoding a prompt of n_prompt tokens from lo to hi,
        as many as this slot's byte share holds."""
        k = slot_count(self.share_bytes, self.ckpt_bytes, self.cap)
        fc = forecast(self.history, n_prompt, population=self.population)
        return plan(fc, have, lo, hi, k, align=self.align, tile=self.tile)

    def forecast(self, n_tokens: int) -> Forecast:
        return forecast(self.history, self.prompt_end or n_tokens, population=self.population)

    # -- decisions -----------------------------------------------------------------------

    def positions(self, pos0: int, n_prompt: int, have: Sequence[int]) -> list[int]:
        """Where to snapshot while the prompt is decoded from pos0 (ascending, > pos0)."""
        if self.keep < 0:
            return []
        if self.policy == "placement":
            self.last = self._plan(n_prompt, have, pos0, n_prompt - 1)
            return self.last
        if self.keep <= 0:
            return []
        every = self.every
        out = list(range((pos0 // every + 1) * every, n_prompt, every))
        end = n_prompt - 1  # the prompt's end, leaving one token to decode for logits
        if end > pos0 and (not out or end - out[-1] >= max(1, every // 8)):
            out.append(end)
        self.last = out
        return out

    def keep_indices(self, ckpts: Sequence[CheckpointLike], raw_lcp: int | None, n_tokens: int) -> list[int]:
        """Indices (ascending) of what a page or file keeps of the slot's list."""
        if self.policy == "placement":
            return keep_best(self.forecast(n_tokens), [c.pos for c in ckpts], self.cap)
        return select_indices(ckpts, self.keep, raw_lcp if self.policy == "divergence" else None)

    def view(self, n_tokens: int) -> tuple[list[Divergence], int, list[float]]:
        """What the budget needs to price this slot's checkpoints the way the slot placed
        them: (history, prompt length, population)."""
        return list(self.history), self.prompt_end or n_tokens, list(self.population)
