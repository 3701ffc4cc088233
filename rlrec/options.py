"""Command options declared once, on dataclasses: command line, environment and config file from them.

A command's options are the fields of one or more dataclasses declared with :func:`option`
(name, type, default, help; choices from a ``Literal[...]`` type). :class:`OptionSet` turns
them into

* argparse arguments: ``--max-file-age-s``; ``--flag/--no-flag`` for booleans; a repeatable
  ``--name KEY=VALUE`` for dict fields; every default and the valid choices shown in ``--help``;
* environment variables ``RLREC_<NAME>`` (``RLREC_MAX_FILE_AGE_S``; booleans ``1/0``,
  ``true/false``; dict fields a JSON object);
* keys of a ``--config`` file (TOML by its ``.toml`` suffix, JSON otherwise), with dashes or
  underscores (``max-file-age-s`` or ``max_file_age_s``; dict fields a table);

(a ``list[str]`` field is a repeatable ``--name VALUE``, comma-separated in the environment, an
array in a file; a field declared ``positional=True`` is a positional argument, given on the
command line only)

and resolves them with the precedence command line > environment > config file > defaults.
A boolean may also be given negated: ``no-create-topics = true`` in a file,
``RLREC_NO_CREATE_TOPICS=1`` in the environment.

Rejected, each with one line naming the option (:class:`OptionError`): a config-file key that
is no option of the command, and a ``RLREC_*`` variable that is no option of *any* command
declared here (nor one of :data:`OTHER_ENV`), both with the nearest valid name; a value of the
wrong type or outside its choices; a required option given nowhere. ``RLREC_*`` variables of
another command's options are ignored, so one environment can serve ``consume`` and ``train``
(an option both commands have, such as ``RLREC_METRICS_PORT``, applies to both).

Fields declared without :func:`option` are not options (settings for programs and tests only).

Standard library only and nothing of ours: any layer may import it (``rlrec.consumer.config``
and ``rlrec.trainer.config`` declare with it), and ``rlrec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    "OTHER_ENV",
    "Option",
    "OptionError",
    "OptionSet",
    "check_choices",
    "option",
    "parse_flag",
    "parse_key_values",
]

_META = "rlrec.option"
#: ``RLREC_*`` variables that are not command options but are read by rlrec (or by its compose
#: file): never reported as unknown. Variables starting with ``RLREC_TEST_`` belong to the tests.
OTHER_ENV = frozenset({"RLREC_POLICY_PUBLIC_KEY", "RLREC_POLICIES", "RLREC_AZURITE"})
_IGNORED_ENV_PREFIXES = ("RLREC_TEST_",)
#: every OptionSet made in this process: the union of their variables is what the environment may hold
_ALL: list[OptionSet] = []
_CACHE: dict[type, list[Option]] = {}


class OptionError(ValueError):
    """An option given wrongly: an unknown name, a bad value, a missing required option."""

    #: a usage error: `rlrec` exits with 2 (rlrec.errors)
    exit_code = 2


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    normalize: Callable[[str], str] | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    const: Any = None,
    name: str | None = None,
    positional: bool = False,
) -> Any:
    """Declare a dataclass field as a command option (a ``dataclasses.field`` carrying its help).

    Args:
        default: the default value; leave it out for a required option.
        help: one sentence for ``--help`` and docs/CONFIG.md (the default, choices and the
            environment variable are added to it).
        default_factory: instead of `default`, for mutable defaults (dict fields).
        normalize: applied to a text value before it is checked, e.g. ``str.upper``.
        parse: turns a text value into the option's type (``"15m"`` -> ``900.0``); its
            ValueError is the option's error.
        metavar: the value's name in ``--help``.
        const: the value of the flag given without a value (``--promotion-gate`` alone); also
            what ``true``/``1`` in the environment or a config file mean (``false``/``0``: the default).
        name: the option's name where it differs from the field's (``from`` for a field
            ``input_format``): ``--from``, ``RLREC_FROM``, key ``from``.
        positional: a positional argument of the command line (``rlrec gc URI``), given there
            only: no environment variable, no config-file key.

    Example:
        >>> import typing
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Opts:
        ...     output: str = option(help="where to write")
        ...     format: typing.Literal["episodes", "tabular"] = option("episodes", help="shard layout")
        >>> opts = OptionSet("example", Opts)
        >>> opts.build(Opts, opts.resolve_values(environ={"RLREC_OUTPUT": "/tmp/x"}))
        Opts(output='/tmp/x', format='episodes')
    """
    meta = {
        _META: {
            "help": help,
            "normalize": normalize,
            "parse": parse,
            "metavar": metavar,
            "const": const,
            "name": name,
            "positional": positional,
        }
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def parse_flag(text: str | bool) -> bool:
    """An on/off value: ``1/true/yes/on`` or ``0/false/no/off`` (any case), or a bool."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not an on/off value: {text!r} (use 1/0, true/false)")


def parse_key_values(items: Iterable[str] | None, flag: str = "KEY=VALUE", *, literal: bool = False) -> dict[str, Any]:
    """``["a=1", "b=x=y"]`` -> ``{"a": "1", "b": "x=y"}`` (split at the first ``=``, key stripped).

    Args:
        items: the ``KEY=VALUE`` texts.
        flag: the option they came from, for the error message.
        literal: parse each value as JSON, then as a Python literal, else keep the text.

    Raises:
        OptionError: an item without ``=`` or with an empty key, or a value nested too deeply.

    Example:
        >>> parse_key_values(["lr=1e-3", "m={'h': [64]}", "x=abc"], "--algo-config", literal=True)
        {'lr': 0.001, 'm': {'h': [64]}, 'x': 'abc'}
    """
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OptionError(f"{flag} expects KEY=VALUE, got {item!r}")
        if literal:
            try:
                out[key] = json.loads(value)
                continue
            except ValueError:
                try:
                    out[key] = ast.literal_eval(value)
                    continue
                except (ValueError, SyntaxError):
                    pass
                except (RecursionError, MemoryError):
                    raise OptionError(f"{flag} {key}: the value nests too deeply") from None
            except RecursionError:
                raise OptionError(f"{flag} {key}: the value nests too deeply") from None
        out[key] = value
    return out


def check_choices(obj: Any) -> None:
    """Raise ValueError if a ``Literal[...]`` option field of dataclass instance `obj` holds
    another value (call it from ``__post_init__``; normalizes the value first)."""
    for opt in _options_of(type(obj)):
        if opt.choices is None:
            continue
        value = getattr(obj, opt.name)
        if isinstance(value, str) and opt.normalize is not None:
            value = opt.normalize(value)
            setattr(obj, opt.name, value)
        if value not in opt.choices and not (value is None and opt.optional):
            raise ValueError(f"{opt.flag} must be one of {', '.join(map(str, opt.choices))}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option, derived from a dataclass field."""

    name: str  # the field: max_file_age_s
    kind: type  # str, int, float, bool, dict or list (of str)
    default: Any  # dataclasses.MISSING: required
    help: str
    choices: tuple | None = None
    optional: bool = False  # None is a value
    accepts_table: bool = False  # a str field that also takes a dict (from a config file)
    literal_values: bool = False  # dict values parsed as JSON/Python literals (dict[str, Any])
    normalize: Callable[[str], str] | None = None
    metavar: str | None = None
    const: Any = None  # the value of the bare flag
    parse: Callable[[str], Any] | None = None
    public: str | None = None  # the option's name where it is not the field's
    positional: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.key

    @property
    def key(self) -> str:
        return (self.public or self.name).replace("_", "-")

    @property
    def env(self) -> str:
        return "RLREC_" + self.key.replace("-", "_").upper()

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    def shown_default(self) -> str | None:
        """The default as --help and the reference show it (None: nothing to show)."""
        if self.required or self.default is None or self.default in ({}, []):
            return None
        if self.kind is bool:
            return "on" if self.default else "off"
        return str(self.default)

    def convert(self, value: Any, where: str) -> Any:
        """`value` (text from the command line or environment; any type from a file) as this
        option's type; OptionError naming the option and `where` otherwise."""
        try:
            return self._convert(value)
        except (TypeError, ValueError) as e:
            raise OptionError(f"{where}: {e}") from None

    def _convert(self, value: Any) -> Any:
        if self.const is not None and self.kind is not bool:
            if value is True or (isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on")):
                return self.const
            if value is False or (isinstance(value, str) and value.strip().lower() in ("0", "false", "no")):
                return self.default
        if value is None or (self.optional and value == ""):
            if self.optional:
                return None
            raise ValueError("a value is required")
        if self.kind is dict:
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, dict):
                raise ValueError(f"expected a table (JSON object), got {value!r}")
            return dict(value)
        if self.kind is list:  # an array, a JSON array, or comma-separated text
            if isinstance(value, str):
                text = value.strip()
                value = json.loads(text) if text.startswith("[") else [v.strip() for v in text.split(",") if v.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"expected a list of strings, got {value!r}")
            return list(value)
        if self.parse is not None and isinstance(value, str):
            value = self.parse(value)
        if self.kind is bool:
            return parse_flag(value)
        if isinstance(value, bool):
            raise ValueError(f"expected {self.kind.__name__}, got {value!r}")
        if self.kind is int:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, str):
                try:
                    value = int(value.strip())
                except ValueError:
                    raise ValueError(f"invalid int value: {value!r}") from None
            if not isinstance(value, int):
                raise ValueError(f"invalid int value: {value!r}")
        elif self.kind is float:
            if isinstance(value, str):
                try:
                    value = float(value.strip())
                except ValueError:
                    raise ValueError(f"invalid float value: {value!r}") from None
            if not isinstance(value, (int, float)):
                raise ValueError(f"invalid float value: {value!r}")
            value = float(value)
        elif self.accepts_table and isinstance(value, dict):
            return value
        elif not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        if self.normalize is not None and isinstance(value, str):
            value = self.normalize(value)
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"invalid choice: {value!r} (choose from {', '.join(map(str, self.choices))})")
        return value


def _kind(tp: Any) -> tuple[type, tuple | None, bool, bool, bool]:
    """(kind, choices, optional, accepts_table, literal_values) of a resolved field type."""
    optional = accepts_table = False
    args = [tp]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
    if len(args) > 1:  # e.g. dict | str: text on the command line, a table in a file
        accepts_table = any(typing.get_origin(a) is dict or a is dict for a in args)
        args = [a for a in args if a is str] or args[:1]
    tp = args[0]
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        return type(choices[0]), choices, optional, accepts_table, False
    if origin is dict or tp is dict:
        value_type = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        return dict, None, optional, False, value_type is not str
    if origin is list and typing.get_args(tp) == (str,):
        return list, None, optional, False, False
    if tp not in (str, int, float, bool):
        raise TypeError(f"option type {tp!r} is not supported (str, int, float, bool, dict, list[str], Literal)")
    return tp, None, optional, accepts_table, False


def _options_of(cls: type) -> list[Option]:
    cached = _CACHE.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META)
        if meta is None:
            continue
        kind, choices, optional, table, literal = _kind(hints[f.name])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out.append(
            Option(
                f.name,
                kind,
                default,
                meta["help"],
                choices,
                optional,
                table,
                literal,
                meta["normalize"],
                meta["metavar"],
                meta["const"],
                meta["parse"],
                meta["name"],
                meta["positional"],
            )
        )
    _CACHE[cls] = out
    return out


def _load_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if path.endswith(".toml"):
            import tomllib

            data = tomllib.loads(raw.decode())
        else:
            data = json.loads(raw)
    except (OSError, ValueError) as e:  # tomllib.TOMLDecodeError and JSONDecodeError are ValueErrors
        raise OptionError(f"cannot read config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise OptionError(f"config file {path}: expected a table of options, got {type(data).__name__}")
    return data


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    near = difflib.get_close_matches(name, sorted(candidates), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


class OptionSet:
    """The options of one command: the option fields of `classes`, in declaration order.

    Args:
        command: the command's name (``consume``), for messages.
        classes: dataclasses whose :func:`option` fields are the command's options (a name
            declared twice is an error).

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Opts:
        ...     partitions: int = option(8, help="partitions")
        ...     resume: bool = option(False, help="continue")
        >>> opts = OptionSet("example", Opts)
        >>> parser = argparse.ArgumentParser()
        >>> opts.add_arguments(parser)
        >>> args = parser.parse_args(["--resume"])
        >>> opts.resolve(args, environ={"RLREC_PARTITIONS": "3"})
        {'partitions': 3, 'resume': True}
        >>> opts.build(Opts, opts.resolve(args, environ={}))
        Opts(partitions=8, resume=True)
    """

    def __init__(self, command: str, *classes: type) -> None:
        self.command = command
        self.classes = classes
        self.options: dict[str, Option] = {}
        for cls in classes:
            for opt in _options_of(cls):
                if opt.name in self.options:
                    raise TypeError(f"option {opt.name!r} of {command} is declared twice")
                self.options[opt.name] = opt
        #: the options the environment and a config file may set, by name (underscores)
        self._settable = {o.key.replace("-", "_"): o for o in self.options.values() if not o.positional}
        _ALL.append(self)

    # -- the command line ---------------------------------------------------------------------

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add ``--config`` and one argument per option to `parser` (their values default to
        None: "not given", so the environment and the file can fill them)."""
        parser.add_argument(
            "--config",
            metavar="FILE",
            help="TOML (.toml) or JSON file of option values; keys as the long option names, "
            "with dashes or underscores",
        )
        for opt in self.options.values():
            help_ = self._help(opt)
            if opt.positional:
                nargs = None if opt.required else "?"
                parser.add_argument(
                    opt.name, nargs=nargs, default=None, metavar=opt.metavar or opt.name.upper(), help=help_
                )
            elif opt.kind is bool:
                parser.add_argument(
                    opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction, default=None, help=help_
                )
            elif opt.kind in (dict, list):
                metavar = opt.metavar or ("KEY=VALUE" if opt.kind is dict else opt.key.upper().replace("-", "_"))
                parser.add_argument(opt.flag, dest=opt.name, action="append", default=None, metavar=metavar, help=help_)
            else:
                metavar = opt.metavar or ("{" + ",".join(map(str, opt.choices)) + "}" if opt.choices else None)
                kw: dict[str, Any] = {"nargs": "?", "const": opt.const} if opt.const is not None else {}
                metavar = metavar or opt.key.upper().replace("-", "_")
                parser.add_argument(opt.flag, dest=opt.name, default=None, metavar=metavar, help=help_, **kw)

    def _help(self, opt: Option) -> str:
        notes = []
        shown = opt.shown_default()
        if opt.required:
            notes.append("required")
        elif shown is not None:
            notes.append(f"default: {shown}")
        if opt.kind in (dict, list):
            notes.append("repeatable")
        if not opt.positional:
            as_ = {bool: "=1", dict: " as a JSON object", list: ", comma-separated"}.get(opt.kind, "")
            notes.append(f"env {opt.env}{as_}")
        if not notes:
            return opt.help.replace("%", "%%")
        return f"{opt.help} ({'; '.join(notes)})".replace("%", "%%")

    # -- resolution ---------------------------------------------------------------------------

    def resolve(self, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """{field: value} of every option: command line > environment > ``args.config`` > defaults.

        Args:
            args: parsed by a parser given :meth:`add_arguments` (texts, not yet converted).
            environ: the environment (default: ``os.environ``).

        A required option given nowhere is None here (:meth:`build` refuses it).

        Raises:
            OptionError: an unknown file key or ``RLREC_*`` variable, or a bad value (one line,
                naming it).
        """
        cli = {}
        for name, opt in self.options.items():
            value = getattr(args, name, None)
            if value is not None:
                if opt.kind is dict:
                    value = parse_key_values(value, opt.flag, literal=opt.literal_values)
                elif opt.positional:
                    value = opt.convert(value, opt.key.upper())
                else:
                    value = opt.convert(value, opt.flag)
                cli[name] = value
        return self.resolve_values(cli, environ, getattr(args, "config", None))

    def resolve_values(
        self,
        cli: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        config_file: str | None = None,
    ) -> dict[str, Any]:
        """Like :meth:`resolve`, with the command line's values already converted in `cli`."""
        environ = os.environ if environ is None else environ
        layers = [self._from_file(config_file) if config_file else {}, self._from_env(environ), dict(cli or {})]
        out: dict[str, Any] = {}
        for name, opt in self.options.items():
            given = [layer[name] for layer in layers if name in layer]
            if opt.kind is dict:  # tables merge: a later layer's keys win
                merged = dict(opt.default)
                for g in given:
                    merged.update(g)
                out[name] = merged
            elif given:
                out[name] = given[-1]
            else:  # None for a required option given nowhere: build() says so
                out[name] = None if opt.required else opt.default
        return out

    def _match(self, key: str) -> tuple[Option, bool] | None:
        """The option a file key or variable suffix names (normalized), and whether it is negated."""
        if key in self._settable:
            return self._settable[key], False
        if key.startswith("no_") and key[3:] in self._settable and self._settable[key[3:]].kind is bool:
            return self._settable[key[3:]], True
        return None

    def _from_file(self, path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for raw_key, value in _load_file(path).items():
            key = str(raw_key).replace("-", "_")
            found = self._match(key)
            if found is None:
                names = [o.key if "-" in str(raw_key) else o.key.replace("-", "_") for o in self._settable.values()]
                raise OptionError(f"unknown option {raw_key!r} in {path}{_did_you_mean(str(raw_key), names)}")
            opt, negated = found
            value = opt.convert(value, f"{raw_key!r} in {path}")
            out[opt.name] = (not value) if negated else value
        return out

    def _from_env(self, environ: Mapping[str, str]) -> dict[str, Any]:
        known = known_env_vars()
        out: dict[str, Any] = {}
        for var, value in environ.items():
            if not var.startswith("RLREC_") or var.startswith(_IGNORED_ENV_PREFIXES):
                continue
            found = self._match(var[len("RLREC_") :].lower())
            if found is None:
                if var not in known:
                    raise OptionError(f"unknown option {var!r} in the environment{_did_you_mean(var, known)}")
                continue  # another command's option
            opt, negated = found
            value = opt.convert(value, var)
            out[opt.name] = (not value) if negated else value
        return out

    def build(self, cls: type, values: Mapping[str, Any], **extra: Any) -> Any:
        """``cls(**the values of its option fields, **extra)``; OptionError for a required
        option without a value and for what `cls` itself refuses (its ValueError)."""
        options = _options_of(cls)
        for opt in options:
            value = values.get(opt.name)
            if opt.required and opt.positional and value is None:  # given empty: the command says what it expects
                raise OptionError(f"{opt.metavar or opt.name.upper()} is required")
            if opt.required and not opt.positional and value in (None, "", []):
                raise OptionError(f"{opt.flag} is required (or {opt.env}, or {opt.key!r} in the --config file)")
        names = {o.name for o in options}
        try:
            return cls(**{k: v for k, v in values.items() if k in names}, **extra)
        except OptionError:
            raise
        except ValueError as e:  # what the dataclass itself refuses is a usage error too (exit 2)
            raise OptionError(str(e)) from e


def known_env_vars() -> set[str]:
    """Every ``RLREC_*`` variable some command declared here reads (booleans also with ``NO_``),
    plus :data:`OTHER_ENV`."""
    out = set(OTHER_ENV)
    for s in _ALL:
        for opt in s._settable.values():
            out.add(opt.env)
            if opt.kind is bool:
                out.add("RLREC_NO_" + opt.name.upper())
    return out
