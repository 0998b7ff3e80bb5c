"""What every engine promises about a `Step`, in one place: the real engine and the stand-in
(actord/testing/fake_engine.py) both run steps through these, so the stand-in that the
hot-path benchmark measures keeps the real contract.

- A step planned in an ended epoch is skipped (`StepSkipped`) and changes nothing; any
  failure of a step ends the epoch, because the steps queued behind it were planned assuming
  it ran (they may feed its samples).
- A step is refused, typed, before it touches memory: empty, over n_batch (draft tokens
  count), a sequence out of range, a sampling entry without a sampler, a `feed_last` with
  nothing sampled last step, a draft that does not follow a token the entry feeds and samples.
"""

from __future__ import annotations

from typing import Any, Callable

from actord.engine import jobs as J
from actord.vocabulary.errors import ActordError, InvalidParams, StepSkipped


def run_in_epoch(engine: Any, job: J.Step, body: Callable[[J.Step], J.StepOut]) -> J.StepOut:
    """Run `body(job)` under `engine.epoch`'s rule (see the module docstring)."""
    if job.epoch != engine.epoch:
        raise StepSkipped("planned before a failed step; nothing ran", epoch=engine.epoch)
    try:
        return body(job)
    except BaseException as e:
        engine.epoch += 1
        if isinstance(e, ActordError):
            e.data.setdefault("epoch", engine.epoch)
        raise


def check_step(job: J.Step, n_batch: int, n_seq_max: int, samplers: Any, last: dict[int, int],
               ended: Any = frozenset()) -> int:
    """Refuse a malformed step; returns its token count. `ended`: sequences whose feed_last
    entries the engine skips (fed a token that ends their request: an eog, a stop token)."""
    # One pass counts and spots a bad entry (the step's hot path); the errors are then
    # raised in their order: the count's first, then the first bad entry's.
    n = 0
    bad = False
    for e in job.entries:
        n += len(e.tokens) + e.feed_last + e.draft
        if not bad and (not 0 <= e.seq < n_seq_max or (e.sample and e.seq not in samplers)
                        or (e.feed_last and e.seq not in last and e.seq not in ended) or e.draft
                        or e.draft_tokens):
            bad = True  # (or a draft: checked below)
    if n == 0:
        raise InvalidParams("empty step")
    if n > n_batch:
        raise InvalidParams(f"step of {n} tokens exceeds n_batch {n_batch}")
    if not bad:
        return n
    for e in job.entries:
        if not 0 <= e.seq < n_seq_max:
            raise InvalidParams(f"sequence {e.seq} out of range", seq=e.seq)
        if e.sample and e.seq not in samplers:
            raise InvalidParams(f"sequence {e.seq} has no sampler", seq=e.seq)
        if e.feed_last and e.seq not in last and e.seq not in ended:
            raise InvalidParams(f"sequence {e.seq} sampled nothing in the last step", seq=e.seq)
        if e.draft and (e.draft < 0 or not e.sample or e.feed_last or e.checkpoint or not e.tokens):
            raise InvalidParams(f"sequence {e.seq}: a draft follows a sampled token the entry feeds", seq=e.seq)
        if e.draft_tokens and e.draft_pos0 < 0:
            raise InvalidParams(f"sequence {e.seq}: draft position {e.draft_pos0}", seq=e.seq)
    return n
