"""Page images compared by value (their buffers may be bytes or memoryviews)."""

from __future__ import annotations

from typing import Any

from actord.storage.pagefile import PageImage


def image_fields(i: PageImage) -> tuple[Any, ...]:
    """The fields a page file round-trips, as plain values."""
    return (
        list(i.tokens),
        bytes(i.state),
        [(c.pos, bytes(c.data)) for c in i.checkpoints],
        [(g.path, g.scale, g.id) for g in i.genes],
        None if i.draft is None else bytes(i.draft),
        dict(i.meta),
    )
