"""What several commands share: KEY=VALUE options and the report of storage errors.

Standard library only at module level (see :mod:`rlrec.cli`).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Iterable

__all__ = ["parse_key_values", "reports_storage_errors"]


def parse_key_values(items: Iterable[str], flag: str) -> dict[str, str]:
    """``["a=1", "b=x=y"]`` -> ``{"a": "1", "b": "x=y"}``; ValueError names `flag` for an item without ``=``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def reports_storage_errors(command: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable]:
    """Decorate a command handler: a storage or manifest error ends it with exit code 2 and one
    line ``rlrec COMMAND: error: Type: message`` on stderr instead of a traceback."""

    def wrap(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            from rlrec.store.manifest import ManifestError
            from rlrec.store.storage import StorageError

            try:
                return handler(args)
            except (StorageError, ManifestError, OSError) as e:
                print(f"rlrec {command}: error: {type(e).__name__}: {e}", file=sys.stderr)
                return 2

        return run

    return wrap
