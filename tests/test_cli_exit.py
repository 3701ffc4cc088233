"""The `rlrec` program ends without the native teardown once torch is imported
(`rlrec.process_exit`, `rlrec.cli.run`): the exit work a Python program relies on still runs,
and what it prints, its exit code and the files it wrote are those of an ordinary exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.trainer.synthetic import expert_cartpole_episodes


def _buffered_env(**more: str) -> dict[str, str]:
    """This environment with stdout block-buffered into a pipe (no PYTHONUNBUFFERED)."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, **more}


#: a module-level object of the process: its __del__ runs only in the interpreter's teardown
FINALIZED = """
import os
class Finalized:
    def __del__(self):
        os.write(2, b"finalized\\n")
keep = Finalized()
"""

EXIT_WORK = FINALIZED + textwrap.dedent(
    """
    import atexit, logging, logging.handlers, sys, threading
    from rlrec.process_exit import exit_process

    release = threading.Event()
    done = []

    def worker():  # a non-daemon thread that ends only once shutdown has begun
        release.wait()
        print("thread done")
        done.append(True)

    threading.Thread(target=worker).start()
    threading._register_atexit(release.set)
    held = logging.handlers.MemoryHandler(10_000, flushLevel=logging.CRITICAL,
                                          target=logging.FileHandler(sys.argv[1]))
    logging.getLogger("exit-test").addHandler(held)
    logging.getLogger("exit-test").warning("logged before exit")  # held until logging.shutdown
    atexit.register(lambda: print("atexit ran after the thread:", done == [True]))
    print("x" * 100_000)  # buffered: stdout is a pipe
    exit_process(3)
    """
)


def test_exit_process_runs_the_exit_work_and_skips_the_teardown(tmp_path):
    log = tmp_path / "held.log"
    p = subprocess.run(
        [sys.executable, "-c", EXIT_WORK, str(log)], capture_output=True, text=True, timeout=120, env=_buffered_env()
    )
    assert p.returncode == 3, p.stderr
    assert p.stdout == "x" * 100_000 + "\nthread done\natexit ran after the thread: True\n", p.stdout[-300:]
    assert log.read_text() == "logged before exit\n"  # logging.shutdown flushed and closed the handler
    assert "finalized" not in p.stderr, p.stderr  # the interpreter's teardown did not run


#: programs whose end is compared between exit_process(code) and sys.exit(code): the last flush
#: fails or is skipped, the standard streams were replaced, threading's exit work raises, the code
#: is beyond a C int; (script, code, the exit code an ordinary exit gives)
AT_THE_EDGES = {
    "stdout's file gone": ("print('held')\nos.close(1)\n", 0, 120),
    "stdout closed by the program": ("print('out', flush=True)\nsys.stdout.close()\n", 0, 0),
    "stderr cannot be flushed": ("print('out')\nsys.stderr.write('partial')\nos.close(2)\n", 0, 120),
    "sys.stdout replaced": ("print('held in the real stdout')\nsys.stdout = io.StringIO()\n", 0, 0),
    "sys.stderr replaced": ("sys.stderr.write('held in the real stderr')\nsys.stderr = io.StringIO()\n", 5, 5),
    "a threading exit hook raises": (
        "atexit.register(print, 'atexit ran')\n"
        "def second_signal():\n    raise KeyboardInterrupt\n"
        "threading._register_atexit(second_signal)\nprint('out')\n",
        143,
        143,
    ),
    "a code beyond a C int": ("print('out')\n", 2**32 + 3, 3),
    "a negative code": ("print('out')\n", -1, 255),
}


@pytest.mark.parametrize("case", AT_THE_EDGES)
def test_at_the_edges_the_end_is_the_interpreters(case):
    """exit code, stdout and stderr are those of sys.exit on the same program."""
    body, code, expected = AT_THE_EDGES[case]
    head = "import atexit, io, os, sys, threading\nfrom rlrec.process_exit import exit_process\n" + body
    ends = []
    for end in (f"exit_process({code})", f"sys.exit({code})"):
        argv = [sys.executable, "-c", head + end]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=_buffered_env())
        ends.append((p.returncode, p.stdout, p.stderr))
    assert ends[0] == ends[1]
    assert ends[0][0] == expected, ends[0]
    if case == "a threading exit hook raises":  # reported as ignored, the exit work went on
        assert ends[0][2].startswith("Exception ignored in: <module 'threading'"), ends[0][2]
        assert ends[0][2].endswith("KeyboardInterrupt: \n") and ends[0][1] == "out\natexit ran\n", ends[0]
    if case.endswith("replaced"):
        assert "held in the real" in ends[0][1] + ends[0][2], ends[0]


def test_exit_process_refuses_a_thread_other_than_the_main_one():
    """The exit work joins every non-daemon thread: from another thread it would wait for itself."""
    script = textwrap.dedent(
        """
        import threading
        from rlrec.process_exit import exit_process
        refused = []
        def end():
            try:
                exit_process(4)
            except RuntimeError as e:
                refused.append(str(e))
        t = threading.Thread(target=end)
        t.start()
        t.join()
        print(refused)
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout) == (0, "['exit_process: call it from the main thread']\n"), p.stderr


#: `rlrec ARGV` through `rlrec.cli.run` (as the console script and `python -m rlrec` call it),
#: with torch imported first or not
PROGRAM = FINALIZED + textwrap.dedent(
    """
    import sys
    if sys.argv[1] == "torch":
        import torch
    from rlrec.cli import run
    sys.argv = ["rlrec", *sys.argv[2:]]
    sys.exit(run())
    """
)


def _rlrec(*args: str, torch: bool) -> subprocess.CompletedProcess:
    env = _buffered_env(COLUMNS="100", PYTHONWARNINGS="ignore")
    flag = "torch" if torch else "plain"
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, flag, *args], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three shards of two CartPole episodes each; the store's root and its steps."""
    root = tmp_path_factory.mktemp("exit") / "out"
    c = ShardCommitter(str(root))
    steps = 0
    for seed in range(3):
        episodes = expert_cartpole_episodes(2, seed=seed, max_steps=20)
        c.commit(episodes)
        steps += sum(e.length for e in episodes)
    return str(root), steps


@pytest.mark.slow  # two fresh interpreters importing torch per case
@pytest.mark.parametrize(
    "case, code",
    [
        ("help", 0),
        ("unknown option", 2),
        ("user error", 2),
        ("inspect", 0),
    ],
)
def test_with_torch_imported_the_program_prints_and_exits_as_without(case, code, store, tmp_path):
    store, _ = store
    args = {
        "help": ["--help"],
        "unknown option": ["inspect", store, "--bogus"],
        "user error": ["export", store, str(tmp_path / "x"), "--to", "parquet", "--as-of", "not-a-point"],
        "inspect": ["inspect", store, "--json"],
    }[case]
    plain, torch = _rlrec(*args, torch=False), _rlrec(*args, torch=True)
    assert torch.returncode == plain.returncode == code, (plain.stderr[-2000:], torch.stderr[-2000:])
    assert torch.stdout == plain.stdout
    assert "finalized" not in torch.stderr, torch.stderr  # it ended through exit_process
    assert torch.stderr == plain.stderr.replace("finalized\n", "")
    if code == 2:
        errors = [line for line in torch.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith("rlrec ") and ": error: " in errors[0], errors
    elif case == "help":
        assert torch.stdout.startswith("usage: rlrec") and "evaluate" in torch.stdout, torch.stdout
    else:
        assert len(json.loads(torch.stdout)["shards"]) == 3, torch.stdout


@pytest.mark.slow
def test_files_the_program_wrote_are_complete(store, tmp_path):
    store, steps = store
    out = tmp_path / "steps"
    p = _rlrec("export", store, str(out), "--to", "parquet", torch=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "finalized" not in p.stderr, p.stderr
    files = sorted(out.rglob("*.parquet"))
    assert files, list(out.rglob("*"))
    assert sum(pq.read_table(f).num_rows for f in files) == steps > 0


@pytest.mark.slow
def test_python_m_rlrec_and_the_console_script_end_through_run():
    """`python -m rlrec` (run as a module after torch was imported) ends through exit_process;
    the console script `rlrec` calls `rlrec.cli:run`."""
    script = FINALIZED + "import runpy, sys, torch\nsys.argv = ['rlrec', '--help']\n"
    script += "runpy.run_module('rlrec', run_name='__main__', alter_sys=True)\n"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=_buffered_env())
    assert p.returncode == 0 and p.stdout.startswith("usage: rlrec"), p.stderr[-2000:]
    assert "finalized" not in p.stderr, p.stderr
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '\nrlrec = "rlrec.cli:run"\n' in pyproject


#: `rlrec` through `rlrec.cli.run` when an exception other than Exception escapes `main` (an async
#: client's CancelledError, a Ctrl-C outside the command), torch imported first or not
ESCAPING = FINALIZED + textwrap.dedent(
    """
    import asyncio, sys
    if sys.argv[1] == "torch":
        import torch
    import rlrec.cli

    def command():
        raise {"cancelled": asyncio.CancelledError, "ctrl-c": KeyboardInterrupt}[sys.argv[2]]()

    rlrec.cli.main = command
    sys.exit(rlrec.cli.run())
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("case, code", [("cancelled", 1), ("ctrl-c", -signal.SIGINT)])
def test_an_exception_escaping_main_ends_as_without_torch(case, code):
    """The traceback and the exit code (1; death by SIGINT for a Ctrl-C) are the interpreter's."""
    ends = []
    for flag in ("plain", "torch"):
        argv = [sys.executable, "-c", ESCAPING, flag, case]
        ends.append(subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_buffered_env()))
    plain, torch = ends
    assert torch.returncode == plain.returncode == code, (plain.stderr[-2000:], torch.stderr[-2000:])
    assert "finalized" not in torch.stderr, torch.stderr  # it ended through exit_process
    assert torch.stderr == plain.stderr.replace("finalized\n", "")
    lines = torch.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and 'File "<string>"' in lines[1], lines
    assert lines[-1] == {"cancelled": "asyncio.exceptions.CancelledError", "ctrl-c": "KeyboardInterrupt"}[case]


@pytest.mark.parametrize("module", ["rlrec.process_exit", "rlrec.cli"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
