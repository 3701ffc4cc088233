"""How `rlrec train` and `rlrec consume` start and stop, as an operator meets them.

* `train` refuses at once (exit 2, one line, before RLlib is imported) an --input that can never
  hold shards: a folder of published policies, a policy version, a checkpoint dir, a folder inside
  a store; otherwise it waits, naming what is missing, and `--first-shard-timeout-s` ends the wait
  (exit 1); it creates a local --checkpoint-dir at start.
* Its start-up phases are said as each begins: the first before RLlib is imported.
* SIGINT and SIGTERM end `train` and `consume` with 130 and 143 after their clean stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

#: runs `rlrec ARGS` and says on stderr when ray.rllib starts being imported
_SPY = textwrap.dedent(
    """
    import sys
    from importlib.abc import MetaPathFinder

    class Spy(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ray.rllib":
                print("IMPORT ray.rllib", file=sys.stderr, flush=True)
                sys.meta_path.remove(self)
            return None

    sys.meta_path.insert(0, Spy())
    from rlrec.cli import run
    sys.argv = ["rlrec", *sys.argv[1:]]
    sys.exit(run())
    """
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREC_")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _train(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _SPY, "train", "--algo", "BC", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def _mistakes(tmp_path):
    store = tmp_path / "data"
    (store / "_manifest" / "rl").mkdir(parents=True)
    pol = tmp_path / "ck" / "policies"
    (pol / "v000001").mkdir(parents=True)
    (pol / "v000001" / "policy.json").write_text("{}")
    (pol / "latest.json").write_text("{}")
    (tmp_path / "ck" / "metrics.jsonl").write_text("")
    return {
        "policies": (pol, "holds published policies"),
        "version": (pol / "v000001", "is a published policy version"),
        "checkpoint-dir": (tmp_path / "ck", "holds published policies"),
        "inside-store": (store / "_manifest", f"is a folder inside the store {store}"),
        "typo-inside-store": (store / "rl-typo", f"give {store}"),
    }


@pytest.mark.parametrize("mistake", ["policies", "version", "checkpoint-dir", "inside-store", "typo-inside-store"])
def test_train_refuses_an_input_that_can_never_hold_shards_at_once(tmp_path, mistake):
    path, says = _mistakes(tmp_path)[mistake]
    r = _train("--input", str(path), "--checkpoint-dir", str(tmp_path / "out"), timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlrec train: error: --input: "), r.stderr
    assert says in lines[0], lines[0]
    assert "IMPORT ray.rllib" not in r.stderr  # at once: before the seconds RLlib takes


@pytest.mark.slow
def test_train_waits_naming_the_reason_and_first_shard_timeout_ends_it(tmp_path):
    ck = tmp_path / "run" / "ck"
    missing = tmp_path / "nothing"
    r = _train("--input", str(missing), "--checkpoint-dir", str(ck), "--first-shard-timeout-s", "1")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == (
        f"rlrec train: error: no committed shard under {missing} within 1 s (--first-shard-timeout-s): "
        "it does not exist yet (rlrec consume --output creates it)"
    ), r.stderr
    assert any("waiting for the first committed shard" in x and "does not exist yet" in x for x in lines), r.stderr
    assert ck.is_dir()  # created at start
    # start-up phases as they begin: the first one before RLlib is imported
    first_phase = next(i for i, x in enumerate(lines) if "rlrec.train: " in x)
    assert first_phase < lines.index("IMPORT ray.rllib"), r.stderr


def _stop_with(argv: list[str], sig: int, ready: str) -> tuple[int, str]:
    """Start `rlrec ARGV`, wait for a stderr line holding `ready`, send `sig`; (exit code, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlrec", *argv], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env()
    )
    lines: list[str] = []
    seen = threading.Event()

    def pump() -> None:
        for line in proc.stderr:
            lines.append(line)
            if ready in line:
                seen.set()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        assert seen.wait(180), "".join(lines)
        time.sleep(0.5)
        proc.send_signal(sig)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    t.join(10)
    return rc, "".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_train_exits_128_plus_the_signal_after_its_clean_stop(tmp_path, sig):
    argv = ["train", "--algo", "BC", "--input", str(tmp_path / "nothing"), "--checkpoint-dir", str(tmp_path / "ck")]
    rc, err = _stop_with(argv, sig, "waiting for the first committed shard")
    assert rc == 128 + sig, err
    assert f"stopped by {signal.Signals(sig).name} after a clean stop: exit code {128 + sig}" in err, err


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_consume_exits_128_plus_the_signal_after_its_clean_stop(broker, topic, tmp_path, sig):
    argv = ["consume", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic, "--output", str(tmp_path)]
    rc, err = _stop_with(argv, sig, "topics ready")
    assert rc == 128 + sig, err
    assert "shutting down" in err and "committed 0 episodes" in err, err


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)
def test_train_says_each_start_up_phase_until_its_first_iteration(tmp_path):
    """No silent minute between "looking for committed shards" and the first iteration: starting
    Ray and building the algorithm (each seconds to a minute on a busy machine) are said as they
    begin, in order."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    store = tmp_path / "data"
    ShardCommitter(str(store)).commit(expert_cartpole_episodes(4, seed=1, max_steps=100))
    r = _train(
        "--input", str(store), "--checkpoint-dir", str(tmp_path / "ck"), "--max-iterations", "1",
        "--num-cpus", "2", "--algo-config", "train_batch_size_per_learner=64", timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.splitlines()

    def first(text: str) -> int:
        found = [i for i, x in enumerate(lines) if text in x]
        assert found, f"no line says {text!r}:\n{r.stderr}"
        return found[0]

    order = [
        first("rlrec.train: looking for committed shards"),
        first("rlrec.trainer: found 1 committed shard(s): starting Ray"),
        first("rlrec.trainer: building BC and its Learner(s)"),
        first("rlrec.trainer: iter 1 "),
    ]
    assert order == sorted(order), r.stderr
