"""What several commands share: the report of storage errors (KEY=VALUE options: :func:`rlrec.options.parse_key_values`).

Standard library only at module level (see :mod:`rlrec.cli`).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

__all__ = ["reports_storage_errors"]


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
