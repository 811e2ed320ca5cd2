"""Running the front end on deeply nested programs.

The parser's LALR automaton is iterative, but the tree-to-AST transformer and the
elaborator recurse once per level of nesting (an operand of an operand, a statement in an
`if` in a `repeat`...). Python's default stack (1,000 frames, 8 MB of C stack on the main
thread) refused programs a few hundred levels deep. So the front end runs in a thread of
its own with a large stack and a recursion limit to match, and the parser refuses nesting
beyond MAX_NESTING levels up front, at the line and column where the limit is passed;
every program within the limit compiles.
"""
from __future__ import annotations

import gc
import sys
import threading

# levels of nesting (of the parse tree) a program may have; well above what anyone writes
# by hand and what generators produce (thousands-long chains), and within the stack below
MAX_NESTING = 20_000
# Python frames per level, at most (transformer, elaborator: expr -> e_Call -> expr ...),
# with room for block calls (64 deep) and the frames below the front end
_FRAMES = 12 * MAX_NESTING + 10_000
# C stack for those frames; virtual memory: only the pages a deep program touches are used
_STACK_BYTES = 1024 * 1024 * 1024

_local = threading.local()  # .inside: this thread already runs the front end
_lock = threading.Lock()
_gc = {"was_enabled": True}
_active = 0
_saved_limit = 0


def run_deep(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a thread with a stack for MAX_NESTING levels; returns its
    result or re-raises its exception here."""
    global _active, _saved_limit
    if getattr(_local, "inside", False):  # already on a deep thread (an import's parse)
        return fn(*args, **kwargs)
    out: dict = {}

    def target():
        _local.inside = True
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = e

    with _lock:
        if _active == 0:
            _saved_limit = sys.getrecursionlimit()
            sys.setrecursionlimit(max(_saved_limit, _FRAMES))
            # The front end allocates millions of small, acyclic objects (parse tree, AST,
            # nodes) and keeps them all alive; each full collection walks all of them, which
            # would make checking cost grow faster than the file. Collect once afterwards
            # instead.
            _gc["was_enabled"] = gc.isenabled()
            gc.disable()
        _active += 1
        old_size = threading.stack_size()
        try:
            threading.stack_size(_STACK_BYTES)  # applies to threads started now
            t = threading.Thread(target=target, name="netdsl-frontend", daemon=True)
            t.start()
        except (RuntimeError, ValueError, MemoryError):
            # no room for the big stack (a `ulimit -v`): run here, with the usual limit;
            # very deep programs then get the per-statement "too deeply" error
            t = None
        finally:
            threading.stack_size(old_size)
    if t is None:
        _release()
        return fn(*args, **kwargs)
    try:
        t.join()
    finally:
        _release()
    if "error" in out:
        raise out["error"].with_traceback(out["error"].__traceback__)
    return out.get("value")


def _release() -> None:
    global _active
    with _lock:
        _active -= 1
        if _active == 0:  # the main thread's small stack needs the usual limit
            sys.setrecursionlimit(_saved_limit)
            if _gc["was_enabled"]:
                gc.enable()
