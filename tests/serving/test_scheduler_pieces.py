"""How the Scheduler cuts prompts into pieces (pure planning over its work table).

A piece cut short by the step's budget ends on a `piece_tile` boundary, so every later
piece is a whole number of tiles (ggml's batched matmuls run those at full speed); a piece
that ends at a checkpoint or finishes the prompt is never moved, and a budget smaller than
a tile is used as it is.
"""

from __future__ import annotations

from actord.serving.steps.core import SchedulerCore
from actord.serving.steps.records import Request
from actord.serving.steps.text import TextState
from actord.engine import jobs as J


def sched(n_batch: int, tile: int) -> SchedulerCore:
    return SchedulerCore(n_batch, piece_tile=tile, depth=1)


def pieces(s: SchedulerCore, pos0: int, n: int, checkpoint_at: list[int] = ()) -> list[tuple[int, int]]:
    """(start, length) of each step's piece for one prompt, stepping the core by hand."""
    r = Request(rid=1, slot=0, seq=0, tokens=list(range(pos0 + n)), n_prompt=pos0 + n, n_done=pos0, n_predict=1,
                checkpoint_at=list(checkpoint_at), text=TextState([], False))
    s.add(r)
    out = []
    while r.n_done < r.n_prompt:
        plan = s.schedule()
        [entry] = plan.step.entries
        out.append((entry.pos0, len(entry.tokens)))
        s.update(plan, J.StepOut(step=1, entries=[J.EntryOut(seq=0, token=7 if entry.sample else -1)], n_tokens=0,
                                 t_decode_ms=0, t_sample_ms=0))
    return out


def test_budget_cut_pieces_end_on_tile_boundaries_after_an_odd_resume():
    got = pieces(sched(512, 64), 411, 1500)
    assert got[0] == (411, 485)  # 411 -> 896: the first piece realigns
    assert all(start % 64 == 0 and length == 512 for start, length in got[1:-1])
    assert sum(length for _, length in got) == 1500 and len(got) == len(pieces(sched(512, 1), 411, 1500))


def test_checkpoint_cuts_and_the_prompts_end_are_never_moved():
    got = pieces(sched(512, 64), 0, 1000, checkpoint_at=[397, 700])
    ends = [start + length for start, length in got]
    assert 397 in ends and 700 in ends and ends[-1] == 1000


def test_a_budget_under_one_tile_is_used_whole_and_tile_one_is_off():
    assert pieces(sched(32, 64), 40, 100) == [(40, 32), (72, 32), (104, 32), (136, 4)]
    assert pieces(sched(512, 1), 411, 600) == [(411, 512), (923, 88)]
