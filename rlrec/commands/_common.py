"""What several commands share: opening an output URI, the report of storage errors (KEY=VALUE options: :func:`rlrec.options.parse_key_values`).

Standard library only at module level (see :mod:`rlrec.cli`).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

__all__ = ["URI_FORMS", "open_output", "plain_console", "reports_storage_errors", "shell_command"]


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


#: how a URI can be written, for error messages
URI_FORMS = "a path, file:///path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix"


def open_output(uri: str, option: str = "URI"):
    """The Storage of `uri` (an output root); UsageError (exit 2) when it is not a URI.

    Args:
        uri: what the user typed.
        option: the option or argument it came from, for the message.

    Example:
        >>> open_output("foo://bar")
        Traceback (most recent call last):
        ...
        rlrec.errors.UsageError: URI: cannot open 'foo://bar': ... (give a path, file:///path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix)
    """
    from rlrec.errors import UsageError
    from rlrec.store.storage import Storage

    if not uri.strip():
        raise UsageError(f"{option} is empty: give {URI_FORMS}")
    try:
        return Storage.from_uri(uri)
    except Exception as e:  # pyarrow: ArrowInvalid for an unknown scheme, ValueError, ...
        raise UsageError(f"{option}: cannot open {uri!r}: {e} (give {URI_FORMS})") from e


def shell_command() -> str:
    """How the user's shell runs this rlrec: ``rlrec`` when the shell finds this installation's
    script on PATH, else that script's path (``.venv/bin/rlrec``, relative to the current
    directory when below it), else ``python -m rlrec`` with this interpreter.

    Example:
        >>> shell_command() in ("rlrec", ".venv/bin/rlrec") or shell_command().endswith("rlrec")
        True
    """
    import os
    import shutil

    mine = os.path.join(os.path.dirname(sys.executable), "rlrec")
    found = shutil.which("rlrec")
    if found and os.path.realpath(found) == os.path.realpath(mine):
        return "rlrec"
    if not os.path.exists(mine):
        return f"{sys.executable} -m rlrec"
    rel = os.path.relpath(mine)
    return mine if rel.startswith("..") else rel


def plain_console(**kwargs):
    """A rich Console that prints every string literally: no markup (``[bold]``, ``[link=...]``,
    ``[/]``), no ``:emoji:`` codes, no highlighting. Data (policy ids, paths, notes) goes through
    it unchanged; the command's own styles are given as ``rich.text.Text`` objects.

    Example:
        >>> import io
        >>> c = plain_console(file=io.StringIO(), width=80)
        >>> c.print("[bold red]x[/] [/] [link=http://x]y[/link] :warning:")
        >>> c.file.getvalue()
        '[bold red]x[/] [/] [link=http://x]y[/link] :warning:\\n'
    """
    from rich.console import Console

    return Console(markup=False, emoji=False, highlight=False, **kwargs)
