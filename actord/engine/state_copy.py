"""A sequence's memory outside the step: copies of its state to and from host memory, cuts.

Owned by the engine (engine/engine.py), on the engine thread only. Page-outs, page-ins,
context checkpoints and the draft context's state all come through `state_get` /
`state_set`; they copy once, straight between libllama and a host buffer (a pooled one, a
mapped page file), because a Gemma 3 state at 4k tokens is tens of MB and every extra pass
over it shows. `seq_rm` guards what recurrent memory only pretends to do.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np

from actord.engine import jobs as J
from actord.engine.context import Context
from actord.engine.draft import Drafter
from actord.engine.llama import lib
from actord.engine.mtp import MtpDrafter
from actord.vocabulary.errors import EngineError, InvalidParams, PageDoesNotFit


class StateCopier:
    """State copies, cuts and shares of the target's sequences, and the draft's state jobs
    (see the module docstring). The context's memory is its state, but for one fact libllama
    cannot answer (`swa_floor`)."""

    def __init__(self, context: Context, drafter: Drafter | MtpDrafter | None) -> None:
        self.context = context
        self.drafter = drafter
        # seq -> the lowest position from which its sliding-window cells run unbroken to its
        # end, where that is above libllama's pos_min: a sequence set from a base and a rest
        # holds the base's last window and the rest's, with a hole between (each part was
        # written without its SWA-masked cells), and pos_min sees only the lowest cell. A cut
        # or share below the floor would attend across the hole (wrong output, seen on the
        # tiny SWA model: a mind on a base paged in, then an earlier message edited).
        self.swa_floor: dict[int, int] = {}

    def pos_min(self, seq: int) -> int:
        """The lowest position from which `seq`'s cells run unbroken to its end."""
        return max(int(lib.llama_memory_seq_pos_min(self.context.mem, seq)), self.swa_floor.get(seq, -1))

    def copied(self, src: int, dst: int) -> None:
        """`dst` was cleared and given `src`'s cells (from position 0): so is its floor."""
        if src in self.swa_floor:
            self.swa_floor[dst] = self.swa_floor[src]
        else:
            self.swa_floor.pop(dst, None)

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """llama_memory_seq_rm, refusing what recurrent memory only pretends to do.

        libllama 0.3.36 on recurrent state (llama_memory_recurrent::seq_rm; hybrid memory asks
        the recurrent part first): erasing a whole sequence works; cutting at or past its end
        changes nothing and returns True; cutting into it returns False when n_rs_seq == 0, and
        with n_rs_seq > 0 returns True for a rollback of up to n_rs_seq tokens (once: the
        snapshot index is single-use), but the snapshots hold the states after the last
        n_rs_seq + 1 tokens of the last ubatch decoded, so the state is right only when the
        position rolled back to lies inside the batch just decoded: after one-token steps it
        is accepted and wrong. A range in the middle [p0, p1) with p1 at or below the end
        returns True and removes nothing. A SeqRm job runs between steps (two steps may be in
        flight), never inside the batch just decoded: on recurrent or hybrid memory it does
        only the whole erase and the cut at the end; any other cut is refused (False) here.
        """
        self.context.check_seq(seq)
        if (self.context.recurrent or self.context.hybrid) and not (p0 <= 0 and p1 < 0):
            end = int(lib.llama_memory_seq_pos_max(self.context.mem, seq)) + 1  # 0 when empty
            if not (p0 >= end and (p1 < 0 or p1 >= p0)):
                return False
        ok = bool(lib.llama_memory_seq_rm(self.context.mem, seq, p0, p1))
        floor = self.swa_floor.get(seq)
        if ok and floor is not None:
            if p0 <= 0 and p1 < 0:
                del self.swa_floor[seq]
            elif p1 < 0 and p0 < floor:
                self.swa_floor[seq] = p0  # its unbroken run is gone: no window below its end
        return ok

    def draft_job(self, job: Any) -> Any:
        """A state job on the draft context's sequence. Without a draft context there is no
        draft state: size 0, nothing to copy, a set that changes nothing."""
        self.context.check_seq(job.seq)
        d = self.drafter
        # The MTP head's state is its carried hidden row (a header) and then its KV.
        head = d.header_size() if isinstance(d, MtpDrafter) else 0
        match job:
            case J.StateSize():
                return head + int(lib.llama_state_seq_get_size_ext(d.ctx, job.seq, 0)) if d is not None else 0
            case J.StateGet():
                if d is None:
                    return J.StateData(data=bytearray(), n_bytes=0, t_ms=0.0)
                st = self.state_get(job.seq, False, ctx=d.ctx)
                if not head:
                    return st
                data = d.header(job.seq) + bytes(st.data)  # type: ignore[union-attr]
                return J.StateData(data=memoryview(data), n_bytes=len(data), t_ms=st.t_ms)
            case J.StateSet():
                if d is None:
                    return J.StateData(data=bytearray(), n_bytes=0, t_ms=0.0)
                data = memoryview(job.data).cast("B")
                if head and not d.adopt_header(job.seq, data):  # type: ignore[union-attr]
                    d.seq_rm(job.seq, -1, -1)
                    return J.StateData(data=bytearray(), n_bytes=0, t_ms=0.0)
                try:
                    return self.state_set(job.seq, data[head:], False, ctx=d.ctx, mem=d.mem)
                except PageDoesNotFit:  # the sequence was cleared: a cold draft, not an error
                    if head:
                        d.seq_rm(job.seq, -1, -1)
                    return J.StateData(data=bytearray(), n_bytes=0, t_ms=0.0)
            case J.MemoryRange():  # the draft's sequences are never set in two parts: no floor
                if d is None:
                    return J.SeqRange(pos_min=-1, pos_max=-1)
                return J.SeqRange(pos_min=int(lib.llama_memory_seq_pos_min(d.mem, job.seq)),
                                  pos_max=int(lib.llama_memory_seq_pos_max(d.mem, job.seq)))
        raise InvalidParams(f"not a draft job: {type(job).__name__}")

    @staticmethod
    def flags(partial: bool) -> int:
        return lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0

    def state_get(self, seq: int, partial: bool, into: J.HostBuffer | None = None, capacity: int = 0,
                  ctx: Any = None, then_erase: bool = False, scratch: bool = False) -> J.StateData:
        """Copy a sequence's state into host memory, once: libllama writes it straight into
        `into` (a pooled, already-faulted buffer) when that is large enough, else into a
        fresh buffer of at least `capacity` bytes. The result views that very buffer. `ctx`:
        another context's sequence (the draft's). `then_erase`: the sequence is removed once
        copied (a page_out's take).

        Into a pooled buffer the state is written without asking its size first
        (llama_state_seq_get_size_ext walks the whole state as a dry run: 0.1 ms of a 1.3 ms
        copy for Gemma at 4k): libllama writes at most the buffer's capacity and answers
        what it wrote, 0 when the state did not fit (then the size is asked and a fresh
        buffer taken). `scratch`: the engine's own sequence (a part-copy), not a client's."""
        if not scratch:
            self.context.check_seq(seq)
        ctx = ctx or self.context.ctx
        t0 = time.perf_counter()
        flags = self.flags(partial)
        n = 0
        if into is not None:
            arr = into.array
            ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            tl = time.perf_counter()
            n = int(lib.llama_state_seq_get_data_ext(ctx, ptr, arr.nbytes, seq, flags))
            lib_s = time.perf_counter() - tl
        if n == 0:
            size = int(lib.llama_state_seq_get_size_ext(ctx, seq, flags))
            # np.empty, not bytearray: a bytearray is zero-filled first, a second pass over
            # every page of a multi-MB buffer (measured: 7.2 ms vs 4.0 ms for 20.5 MB, where a
            # copy into a warm buffer took 4.1 ms).
            arr = np.empty(max(size, capacity, 1), dtype=np.uint8)
            ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            tl = time.perf_counter()
            n = int(lib.llama_state_seq_get_data_ext(ctx, ptr, size, seq, flags))
            lib_s = time.perf_counter() - tl
            if n != size:
                raise EngineError(f"state copy wrote {n} of {size} bytes", seq=seq)
        t = time.perf_counter()
        if then_erase:  # not part of the copy's time (libllama's seq_rm: ~0.4 ms for 4k cells)
            self.seq_rm(seq, -1, -1)
        return J.StateData(data=memoryview(arr)[:n], n_bytes=n, t_ms=(t - t0) * 1e3, lib_ms=lib_s * 1e3)

    def state_set(self, seq: int, data: Any, partial: bool, ctx: Any = None, mem: Any = None,
                  scratch: bool = False) -> J.StateData:
        """Set a sequence's state from host memory, read in place: libllama is handed the
        buffer's own address (a read-only buffer too, a mapped page file say), no copy."""
        if not scratch:
            self.context.check_seq(seq)
        if ctx is None:  # the target's sequence: libllama clears what is set, a hole included
            self.swa_floor.pop(seq, None)
        ctx, mem = ctx or self.context.ctx, mem or self.context.mem
        t0 = time.perf_counter()
        view = memoryview(data).cast("B")
        size = view.nbytes
        # numpy takes any contiguous buffer, read-only ones included, without copying.
        src_arr = np.frombuffer(view, dtype=np.uint8) if size else np.empty(1, dtype=np.uint8)
        src = ctypes.cast(src_arr.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        tl = time.perf_counter()
        n = int(lib.llama_state_seq_set_data_ext(ctx, src, size, seq, self.flags(partial)))
        lib_s = time.perf_counter() - tl
        del src, src_arr
        if n == 0:
            # libllama clears the destination sequence when a restore fails part-way.
            lib.llama_memory_seq_rm(mem, seq, -1, -1)
            raise PageDoesNotFit(
                "the state does not fit this context (or was taken from another model)",
                seq=seq, n_bytes=size,
            )
        return J.StateData(data=bytearray(), n_bytes=n, t_ms=(time.perf_counter() - t0) * 1e3, lib_ms=lib_s * 1e3)


    # -- parts of a sequence (shared prefixes: serving/prefix_share.py) -------------------

    def seq_holds_prefix(self, seq: int, n: int) -> bool:
        """Does `seq` hold positions [0, n) whole, as cells another sequence can share? Not
        on recurrent memory (one state, at the end); on sliding-window layers only while the
        window of position n is still there, every cell of it (`window_whole`)."""
        if self.context.recurrent or self.context.hybrid or n <= 0:
            return False
        if int(lib.llama_memory_seq_pos_max(self.context.mem, seq)) + 1 < n:
            return False
        return self.window_whole(seq, n)

    def window_whole(self, seq: int, n: int) -> bool:
        """Does `seq` hold, in its sliding-window layers, every position that position n
        attends to: [n - n_swa, n)? Asked in the same engine call as the cut or share that
        relies on it, for no other call may come between: libllama (llama_kv_cache::find_slot)
        gives a cell the window has passed, held by one sequence alone, to any sequence's
        next tokens, a full SWA cache's too, so an idle sequence's older cells go at any step
        and not lowest first (seed 313 x 60 steps: a cut to 1 kept position 0 in the
        attention layers, but another slot's prefill had taken it in the SWA layers, between
        the check and the cut). pos_min sees the lowest cell only; the count is exact: the
        window's part is shared into the scratch sequence and its cells counted by the size
        of its sliding-window state (libllama writes the cells it holds, none it lacks).
        Four size calls and three shares at most: no state is copied."""
        w = self.context.n_swa
        if not w or n <= 0:
            return True
        lo = max(0, n - w)
        if self.pos_min(seq) > lo or int(lib.llama_memory_seq_pos_max(self.context.mem, seq)) + 1 < n:
            return False
        return self._cells_in(seq, lo, n) == n - lo

    def _cells_in(self, seq: int, p0: int, p1: int) -> int:
        """How many of positions [p0, p1) `seq` holds in its sliding-window layers."""
        mem, scratch, ctx = self.context.mem, self.context.scratch, self.context.ctx
        flags = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY

        def size(a: int, b: int) -> int:
            lib.llama_memory_seq_rm(mem, scratch, -1, -1)
            if b > a:
                lib.llama_memory_seq_cp(mem, seq, scratch, a, b)
            return int(lib.llama_state_seq_get_size_ext(ctx, scratch, flags))

        # A state's size is a header, a part per layer, and a part per cell: measured at the
        # top one and two cells, it counts the rest.
        try:
            empty, one = size(0, 0), size(p1 - 1, p1)
            if one == empty or p1 - p0 == 1:
                return int(one > empty)
            two, all_ = size(p1 - 2, p1), size(p0, p1)
        finally:
            lib.llama_memory_seq_rm(mem, scratch, -1, -1)
        per_cell = two - one
        return 1 + (all_ - one) // per_cell if per_cell > 0 else 1

    def seq_share(self, src: int, dst: int, n: int) -> bool:
        self.context.check_seq(src)
        self.context.check_seq(dst)
        if src == dst:
            raise InvalidParams("a sequence cannot share its own cells", seq=src)
        if not self.seq_holds_prefix(src, n):
            return False
        if self.drafter is not None:
            self.drafter.seq_rm(dst, -1, -1)
        lib.llama_memory_seq_rm(self.context.mem, dst, -1, -1)
        lib.llama_memory_seq_cp(self.context.mem, src, dst, 0, n)
        self.copied(src, dst)
        return True

    def seq_share_from_checkpoint(self, src: int, dst: int, n: int, data: Any) -> bool:
        """dst from src's cells below n (attention layers: shared, as seq_share) and src's
        checkpoint at n for what cannot be shared (recurrent state, sliding-window cells):
        libllama reads a partial state into dst's recurrent (or SWA) memory only, after
        clearing just that part, so the attention cells stay. False, dst empty, when src no
        longer holds n positions or libllama refuses the checkpoint."""
        self.context.check_seq(src)
        self.context.check_seq(dst)
        if src == dst:
            raise InvalidParams("a sequence cannot share its own cells", seq=src)
        if n <= 0 or int(lib.llama_memory_seq_pos_max(self.context.mem, src)) + 1 < n:
            return False
        if self.drafter is not None:
            self.drafter.seq_rm(dst, -1, -1)
        lib.llama_memory_seq_rm(self.context.mem, dst, -1, -1)
        lib.llama_memory_seq_cp(self.context.mem, src, dst, 0, n)
        try:
            self.state_set(dst, data, True)  # its window from the checkpoint: no floor
        except PageDoesNotFit:
            return False  # (state_set cleared dst)
        if int(lib.llama_memory_seq_pos_max(self.context.mem, dst)) + 1 != n:
            lib.llama_memory_seq_rm(self.context.mem, dst, -1, -1)
            return False
        return True

    def state_get_range(self, seq: int, p0: int, p1: int, partial: bool, into: J.HostBuffer | None,
                        capacity: int) -> J.StateData:
        """The state of positions [p0, p1) of `seq` only: the scratch sequence shares those
        cells, its state is written out, and it lets them go (the cells are not copied). A
        range ending at p1 whose sliding window at p1 is not whole is no state (empty): a
        window checkpoint, or a base ([0, p1): page_bases.py), without cells its window lost
        would resume wrong (seeds 457 and 581 x 60 steps: a base cut from a longer idle
        sequence on a full SWA cache, its window's cells given to other slots' prefills,
        taken by a new mind, answered garbage from its first token)."""
        self.context.check_seq(seq)
        if p1 >= 0 and not self.window_whole(seq, p1):
            return J.StateData(data=bytearray(), n_bytes=0, t_ms=0.0)
        scratch = self.context.scratch
        lib.llama_memory_seq_rm(self.context.mem, scratch, -1, -1)
        try:
            lib.llama_memory_seq_cp(self.context.mem, seq, scratch, p0, p1)
            if int(lib.llama_memory_seq_pos_max(self.context.mem, scratch)) < 0:
                raise InvalidParams(f"sequence {seq} holds nothing in [{p0}, {p1})", seq=seq, p0=p0, p1=p1)
            return self.state_get(scratch, partial, into, capacity, scratch=True)
        finally:
            lib.llama_memory_seq_rm(self.context.mem, scratch, -1, -1)

    def state_set_on_base(self, job: J.StateSet) -> J.StateData:
        """A sequence from a base (another sequence's first cells, or a prefix's state) and
        the state of what follows it, set through the scratch sequence (libllama's state
        read clears its destination first, so the two parts cannot go into one sequence)."""
        seq, scratch, t0 = job.seq, self.context.scratch, time.perf_counter()
        self.context.check_seq(seq)
        n_bytes = 0
        try:
            if job.base_seq >= 0:
                if not self.seq_share(job.base_seq, seq, job.n_base):
                    raise PageDoesNotFit(f"sequence {job.base_seq} no longer holds the {job.n_base} shared positions",
                                         seq=seq, base_seq=job.base_seq, n_base=job.n_base)
            elif job.base is not None:
                n_bytes += self.state_set(seq, job.base, job.partial).n_bytes
            if memoryview(job.data).nbytes:
                n_bytes += self.state_set(scratch, job.data, job.partial, scratch=True).n_bytes
                rest_from = int(lib.llama_memory_seq_pos_min(self.context.mem, scratch))
                lib.llama_memory_seq_cp(self.context.mem, scratch, seq, job.n_base, -1)
                if self.context.n_swa and rest_from > job.n_base:  # the rest's window begins past the base
                    self.swa_floor[seq] = max(rest_from, self.swa_floor.get(seq, -1))
            held = int(lib.llama_memory_seq_pos_max(self.context.mem, seq)) + 1
            if job.n_tokens >= 0 and held != job.n_tokens:
                raise PageDoesNotFit(f"a base and its rest made {held} positions, not {job.n_tokens}",
                                     seq=seq, n_tokens=job.n_tokens, held=held)
        except BaseException:
            lib.llama_memory_seq_rm(self.context.mem, seq, -1, -1)
            self.swa_floor.pop(seq, None)
            if self.drafter is not None:
                self.drafter.seq_rm(seq, -1, -1)
            raise
        finally:
            lib.llama_memory_seq_rm(self.context.mem, scratch, -1, -1)
        return J.StateData(data=bytearray(), n_bytes=n_bytes, t_ms=(time.perf_counter() - t0) * 1e3)
