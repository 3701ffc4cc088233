"""What several commands share: opening an output URI, the report of storage errors (KEY=VALUE options: :func:`rlrec.options.parse_key_values`).

Standard library only at module level (see :mod:`rlrec.cli`).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

__all__ = [
    "AS_OF_HELP",
    "URI_FORMS",
    "open_output",
    "parse_as_of",
    "plain_console",
    "reports_storage_errors",
    "shell_command",
]


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
        rlrec.errors.UsageError: URI: cannot open 'foo://bar': unknown URI scheme 'foo' (give a path, file:///path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix)
    """
    from rlrec.errors import UsageError
    from rlrec.store.storage import Storage

    if not uri.strip():
        raise UsageError(f"{option} is empty: give {URI_FORMS}")
    try:
        return Storage.from_uri(uri)
    except Exception as e:  # ValueError for a malformed URI or an unknown scheme, ...
        if str(e).startswith("cannot open "):  # Storage.from_uri's own: it says what to write
            raise UsageError(f"{option}: {e}") from e
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


def require_manifest(storage, uri: str) -> None:
    """RuntimeFailure (exit 1) unless `storage` holds an rlrec manifest; names a child folder
    that holds one (one level down) when there is one.

    Args:
        storage: the output's Storage.
        uri: the URI as the user typed it, for the message.

    Example:
        >>> import tempfile, pathlib
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "shards" / "_manifest").mkdir(parents=True)
        >>> from rlrec.store.storage import Storage
        >>> require_manifest(Storage.from_uri(str(root)), "out")
        Traceback (most recent call last):
        ...
        rlrec.errors.RuntimeFailure: no rlrec manifest at out (did you mean out/shards?)
    """
    from rlrec.errors import RuntimeFailure
    from rlrec.store.manifest import MANIFEST_DIR

    if storage.exists(MANIFEST_DIR):
        return
    children = [f.name for f in storage.list("") if f.is_dir and not f.name.startswith((".", "_"))]
    found = [c for c in children if storage.exists(f"{c}/{MANIFEST_DIR}")]
    base = uri.rstrip("/")
    if found:
        hint = " or ".join(f"{base}/{c}" for c in found[:3])
        raise RuntimeFailure(f"no rlrec manifest at {uri} (did you mean {hint}?)")
    what = "it does not exist" if not storage.exists("") else "it holds no _manifest folder"
    raise RuntimeFailure(f"no rlrec manifest at {uri}: {what} (give the --output of rlrec consume)")


#: the help of every --as-of option
AS_OF_HELP = (
    "the point of the manifest to read: a UNIX time (1764216000.5), an ISO 8601 time "
    "(2026-11-27T04:00:00Z) or a cursor (printed by rlrec export and inspect --paths); default: the newest"
)


def parse_as_of(text: str | None) -> float | str | None:
    """``--as-of`` text -> a UNIX time (from a number or an ISO 8601 time) or a cursor string.

    Example:
        >>> parse_as_of("1764216000.5"), parse_as_of("2026-11-27T04:00:00Z"), parse_as_of("r1~0123456789ab~rl:0=3")
        (1764216000.5, 1795752000.0, 'r1~0123456789ab~rl:0=3')
    """
    from datetime import datetime, timezone

    if text is None or not text.strip():
        return None
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return text  # a cursor (open_snapshot says if it is not one)
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()
