"""Typing mistakes get one line that helps: unknown options name the command and the nearest
option, abbreviations are refused, a URI missing a slash or with an unknown scheme says so, and
`as_of` speaks ISO 8601 both ways."""

from __future__ import annotations

import datetime
import time

import pyarrow as pa
import pytest

import rlrec
from rlrec.cli import _all_parsers, build_parser, main
from rlrec.store.commit import ShardCommitter
from rlrec.store.snapshot import CursorError
from rlrec.trainer.synthetic import expert_cartpole_episodes


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["consume", "--ouput", "x"],
            "rlrec consume: error: unrecognized option '--ouput' (did you mean --output?) (see rlrec consume --help)",
        ),
        (
            ["topics", "create", "--topicc", "t"],
            "rlrec topics create: error: unrecognized option '--topicc' (did you mean --topic?) "
            "(see rlrec topics create --help)",
        ),
        # an abbreviation is a typo: not taken as --max-seconds
        (
            ["consume", "--output", "x", "--max-second", "3"],
            "rlrec consume: error: unrecognized option '--max-second' (did you mean --max-seconds?) "
            "(see rlrec consume --help)",
        ),
        (
            ["inspect", "x", "--verif"],
            "rlrec inspect: error: unrecognized option '--verif' (did you mean --verify?) (see rlrec inspect --help)",
        ),
    ],
)
def test_unknown_option_names_the_command_and_the_nearest_option(capsys, argv, line):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert _one_line(capsys) == line


def test_no_command_accepts_abbreviations():
    parsers = _all_parsers(build_parser())
    assert len(parsers) > 15
    assert [p.prog for p in parsers if p.allow_abbrev] == []


@pytest.mark.parametrize("uri", ["s3:/bucket/x", "gs:bucket/x"])
def test_a_uri_missing_a_slash_is_refused(capsys, uri):
    assert main(["inspect", uri]) == 2
    line = _one_line(capsys)
    assert f"cannot open {uri!r}: a malformed URI (write {uri[:2]}://bucket/prefix)" in line, line


def test_an_unknown_scheme_is_a_clear_error_not_arrow_invalid():
    with pytest.raises(ValueError, match="unknown URI scheme 's3x'") as e:
        rlrec.open("s3x://bucket/x")
    assert not isinstance(e.value, pa.ArrowInvalid)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("asof"))
    ShardCommitter(root, "rl", 0).commit(expert_cartpole_episodes(2))
    time.sleep(1.1)  # a time to the second after the commit is after it
    return root


def test_as_of_errors_print_iso_times(store):
    with pytest.raises(CursorError) as e:
        rlrec.open(store, as_of=0)
    assert "as_of 1970-01-01T00:00:00.000Z (UNIX 0.000) is before any commit" in str(e.value)
    assert "the first commit is at 20" in str(e.value)


def test_as_of_takes_iso_times_and_dates(store, monkeypatch):
    from rlrec.store import snapshot

    monkeypatch.setattr(snapshot, "APPEND_WINDOW_S", 0.05)  # as_of times this far back are fixed points
    newest = rlrec.open(store).cursor
    time.sleep(1.1)  # the second-resolution string below is still after every commit
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=0.06)
    assert rlrec.open(store, as_of=now.isoformat()).cursor == newest
    assert rlrec.open(store, as_of=now.strftime("%Y-%m-%dT%H:%M:%SZ")).cursor == newest
    assert rlrec.open(store, as_of=now).cursor == newest
    with pytest.raises(CursorError, match="before any commit"):
        rlrec.open(store, as_of=datetime.date(2020, 1, 1))
