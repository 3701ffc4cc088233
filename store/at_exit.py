"""Readers' background work ends before the interpreter finalizes.

An iterator its caller abandons without closing (`Snapshot.iter_steps`, `Snapshot.to_torch`)
would otherwise keep its read-ahead threads reading shards while Python shuts down, and be torn
down during finalization with Arrow objects still alive, when pyarrow's native threads can no
longer call into the interpreter (at worst the process aborts: "terminate called without an
active exception"). Two hooks stop that work in order:

* when shutdown begins, before the interpreter joins non-daemon threads, every read-ahead pool
  cancels the reads it has not started: its threads end after the read in hand (a reader still
  iterating in a live thread reads its next shards itself);
* at exit, after those threads are joined, every iterator still open is closed, so its pool is
  shut down and its tables are released while the interpreter is whole.

Example:
    >>> from rlrec.store.at_exit import close_at_exit, read_ahead_pool
    >>> pool = read_ahead_pool(2, "example")
    >>> pool.submit(sum, [1, 2]).result()
    3
    >>> pool.shutdown()
    >>> rows = close_at_exit(x for x in range(3))
    >>> next(rows)
    0
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["close_at_exit", "read_ahead_pool"]

log = logging.getLogger("rlrec.at_exit")
T = TypeVar("T")
_pools: weakref.WeakSet[ThreadPoolExecutor] = weakref.WeakSet()
_iterators: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()


def read_ahead_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose reads not yet started are cancelled when interpreter shutdown begins
    (`submit` then raises RuntimeError: read inline instead).

    Args:
        threads: its threads.
        name: the prefix of their names.

    Example:
        >>> pool = read_ahead_pool(1, "doc")
        >>> pool.submit(len, "abc").result()
        3
        >>> pool.shutdown()
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
    with _lock:
        _pools.add(pool)
    return pool


def close_at_exit(iterator: T) -> T:
    """`iterator` (a generator, or anything weakly referable with `close()`), closed at exit if
    its caller abandoned it open; it is held weakly: dropping it still frees it at once.

    Args:
        iterator: the iterator to close at exit.

    Example:
        >>> def rows():
        ...     yield from range(3)
        >>> it = close_at_exit(rows())
        >>> next(it)
        0
    """
    with _lock:
        _iterators.add(iterator)
    return iterator


def _cancel_pending_reads() -> None:
    with _lock:
        pools = list(_pools)
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)


def _close_open_iterators() -> None:
    with _lock:
        iterators = list(_iterators)
    for it in iterators:
        try:
            it.close()
        except Exception as e:  # at exit: one iterator's trouble must not keep the others open
            log.debug("closing an abandoned iterator at exit: %s: %s", type(e).__name__, e)


# threading's exit hooks run first (newest first) when shutdown begins, before the joins of
# non-daemon threads, concurrent.futures' own included; `atexit` hooks run after those joins.
getattr(threading, "_register_atexit", atexit.register)(_cancel_pending_reads)
atexit.register(_close_open_iterators)
