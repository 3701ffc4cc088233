"""The error contract of every ``rlrec`` command: one line on stderr and a documented exit code.

A user mistake or an unreachable dependency ends a command with exactly one line::

    rlrec <command>: error: <what is wrong and what to do>

and exit code :data:`EXIT_USAGE` (2: the command line, a config file, an input that does not
exist or is not what the command needs, a store without create-once writes) or
:data:`EXIT_FAILURE` (1: something failed while running: an unreachable broker, a verification
that found problems). A traceback is shown only with ``rlrec --debug``.

Raise :class:`UsageError` or :class:`RuntimeFailure` from a command handler (or anything it calls)
and :func:`rlrec.cli.main` prints the line. An exception class of another module joins the
contract by declaring an ``exit_code`` class attribute (``rlrec.options.OptionError`` and
``rlrec.store.storage.ConditionalWritesError`` declare 2); any other exception gets the same one
line with its type and a hint to rerun with ``--debug``, and exit code 1.

Standard library only, nothing of ours: every layer may raise these.
"""

from __future__ import annotations

__all__ = [
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "RuntimeFailure",
    "UsageError",
    "error_line",
    "exit_code_for",
]

#: a runtime failure: an unreachable dependency, a verification that found problems
EXIT_FAILURE = 1
#: a usage or configuration error: options, config files, inputs, a store without create-once writes
EXIT_USAGE = 2


class UsageError(ValueError):
    """A usage or configuration error (exit code 2); the message says what is wrong and what to do."""

    exit_code = EXIT_USAGE


class RuntimeFailure(RuntimeError):
    """A failure while running (exit code 1), e.g. a dependency that cannot be reached; the
    message says what is wrong and what to do."""

    exit_code = EXIT_FAILURE


def _ours(exc: BaseException) -> bool:
    """Whether `exc`'s message is written for the user (no type name, no --debug hint): ours,
    or any exception class that declares an ``exit_code``."""
    return isinstance(getattr(exc, "exit_code", None), int)


def exit_code_for(exc: BaseException) -> int:
    """The exit code a command ends with when `exc` escapes its handler.

    Args:
        exc: the exception.

    Example:
        >>> exit_code_for(UsageError("--output is required"))
        2
        >>> exit_code_for(ConnectionError("refused"))
        1
    """
    return exc.exit_code if _ours(exc) else EXIT_FAILURE


def error_line(command: str, exc: BaseException) -> str:
    """The one line that reports `exc` for ``rlrec COMMAND`` (newlines in the message folded).

    Args:
        command: the command as typed after ``rlrec`` (``inspect``, ``topics create``).
        exc: the exception.

    Example:
        >>> error_line("inspect", UsageError("not a URI: 'foo://bar'"))
        "rlrec inspect: error: not a URI: 'foo://bar'"
        >>> error_line("train", KeyError("x"))
        "rlrec train: error: KeyError: 'x' (rerun with rlrec --debug for the traceback)"
    """
    text = " / ".join(part.strip() for part in str(exc).strip().splitlines() if part.strip())
    if not _ours(exc):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        text += " (rerun with rlrec --debug for the traceback)"
    return f"rlrec {command}: error: {text}"
