"""The incremental text state of one generating request: decode, stop strings, streaming.

Why it is built this way: a request may generate tens of thousands of tokens, and the
scheduler core calls `push` once per token, so a push must cost O(piece + longest stop)
whatever the length of the output so far. Nothing here re-decodes or slices the whole
text per token:

- the bytes are kept in one bytearray (amortized O(1) append); stop strings are searched
  on those bytes only in the new tail, from `longest stop - 1` bytes before the previous
  end (an occurrence wholly inside bytes searched before would have stopped us then);
- streamed text comes from a `codecs` incremental UTF-8 decoder, so a character split
  across tokens waits in the decoder instead of streaming as U+FFFD;
- the last `longest stop - 1` decoded characters are held back: a stop string that shows
  up later must end in bytes not decoded yet, so it starts at most that many characters
  before the decoded end, and whatever was streamed is always a prefix of the final text;
- at a stop hit the cut is a character offset computed from the small tail between the hit
  and the decoder's position, not by decoding the text before it.

The final text is the UTF-8 decoding (errors="replace") of the bytes before the first
byte match of any non-empty stop string, or of all bytes. The push that completes a stop
string ends the text, so "first" is among the bytes pushed until then: a longer stop that
would start earlier but complete only in a later piece never exists. This is the behaviour of
`actord/serving/slot.py` (`_find_stop`, `_stream_safe`, `_finish`), which this replaces.
A stop string is valid UTF-8, so its first byte is never a continuation byte: a byte match
always starts at a character boundary of the decoded text, even in invalid input (the
decoder replaces an incomplete sequence before a non-continuation byte and restarts there).
Pure and synchronous, stdlib only: the scheduler core owns the concurrency.
"""

from __future__ import annotations

import codecs

__all__ = ["TextState"]


class TextState:
    """The text of one generating request, fed one token's bytes at a time."""

    __slots__ = ("_buf", "_stops", "_longest", "_hold", "_scanned", "_decoder",
                 "_pending", "_cut", "_finished")

    def __init__(self, stop: list[str], stream: bool) -> None:
        self._buf = bytearray()
        self._stops = [s.encode() for s in stop if s]  # an empty stop string would match at once
        self._longest = max(map(len, self._stops), default=0)  # bytes: the scan overlap
        # Characters, and counted over `stop` as given, exactly as slot.py holds back.
        self._hold = max(0, max((len(s) for s in stop), default=1) - 1)
        self._scanned = 0  # bytes already searched for stop strings
        # Only a streaming request needs text before the end: None means not streaming.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace") if stream else None
        self._pending = ""  # decoded, not streamed yet: at most hold + one piece's characters
        self._cut: int | None = None  # byte offset of the first stop match, once one hit
        self._finished = False

    @property
    def n_bytes(self) -> int:
        """Bytes pushed (including those at and after a stop match)."""
        return len(self._buf)

    @property
    def stopped(self) -> bool:
        """A stop string hit: the text is cut and pushes are errors."""
        return self._cut is not None

    def push(self, piece: bytes) -> tuple[str, bool]:
        """Append one token's bytes. Returns (delta, stopped): `delta` is newly decoded text
        that can be streamed now (it can no longer become part of a stop string; '' when not
        streaming or nothing is safe yet); `stopped` is True when a stop string now occurs in
        the text (the text is then cut at the first occurrence and later pushes are errors)."""
        if self._cut is not None or self._finished:
            raise RuntimeError("TextState.push after the text ended (stop string hit or finish called)")
        self._buf += piece
        if self._decoder is None and not self._stops:  # nothing to stream, nothing to stop on
            return "", False
        hit = self._find_stop()
        if self._decoder is None:
            if hit is not None:
                self._cut = hit
            return "", hit is not None
        self._pending += self._decoder.decode(piece, final=False)
        if hit is not None:
            self._cut_pending(hit)
            return "", True
        safe = len(self._pending) - self._hold
        if safe <= 0:
            return "", False
        delta, self._pending = self._pending[:safe], self._pending[safe:]
        return delta, False

    def finish(self) -> str:
        """The final text delta not streamed yet (everything held back, minus what a stop
        cut off). Idempotent: a second call returns ''."""
        if self._finished:
            return ""
        self._finished = True
        if self._decoder is None:
            return self.text  # nothing was streamed: all of it is still to come
        if self._cut is None:
            self._pending += self._decoder.decode(b"", final=True)
        out, self._pending = self._pending, ""
        return out

    def at_boundary(self) -> bool:
        """Whether the text so far ends whole: no stop string watched across its end, nothing
        held back, no character cut in two. A request may end a part here and go on in
        another (policy/yielding.py) with the same text as one part would have made."""
        if self._stops or self._cut is not None or self._finished or self._pending:
            return False
        if self._decoder is not None:
            return not self._decoder.getstate()[0]
        return ends_whole(self._buf)

    @property
    def text(self) -> str:
        """The whole final text (cut at the stop string if one hit); may be O(n), called once at the end."""
        end = len(self._buf) if self._cut is None else self._cut
        return self._buf[:end].decode("utf-8", errors="replace")

    def _find_stop(self) -> int | None:
        """The byte offset of the first stop match in the text, searching the new tail only."""
        if not self._stops:
            return None
        start = max(0, self._scanned - self._longest + 1)
        self._scanned = len(self._buf)
        hits = [i for i in (self._buf.find(s, start) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _cut_pending(self, hit: int) -> None:
        """Drop from `pending` the characters decoded from bytes at and after the match at `hit`.

        The decoder has turned bytes [0, end) into characters and holds the rest, an
        incomplete sequence the match cannot reach into (it would need that character
        whole). `hit` is a character boundary, so bytes [hit, end) decode on their own to
        exactly the characters to drop; they lie in the new tail, so this is O(piece +
        longest stop). They never reach into streamed text: the hold-back sees to that."""
        self._cut = hit
        end = len(self._buf) - len(self._decoder.getstate()[0])  # type: ignore[union-attr]
        assert hit <= end, (hit, end)
        n_drop = len(self._buf[hit:end].decode("utf-8", errors="replace"))
        assert n_drop <= len(self._pending), "a stop match reached into streamed text"
        self._pending = self._pending[:len(self._pending) - n_drop]


def ends_whole(buf: bytes | bytearray) -> bool:
    """Whether `buf` does not end inside a UTF-8 character that more bytes could complete (a
    lone run of continuation bytes ends one): a yield's boundary here, a thought's count in
    steps/thought.py."""
    for back in range(1, min(4, len(buf)) + 1):
        b = buf[-back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII): how long its sequence is
            need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            return back >= need
    return True  # only continuation bytes: nothing more could make them whole
