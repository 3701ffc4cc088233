"""`rlrec broker` listens on Kafka's port 9092 when it is free (so `kafka:9092` snippets need only
the host changed), else on a free port, and says so."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from rlrec.commands.broker import KAFKA_PORT, default_port
from rlrec.local import wait_for_broker


def test_the_preferred_port_when_free_else_a_free_one():
    assert KAFKA_PORT == 9092
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert default_port(taken) is None
    assert default_port(taken) == taken  # closed again: free


@pytest.mark.broker
def test_the_preferred_port_taken_while_starting_falls_back_to_a_free_one(tmp_path, monkeypatch, capsys):
    """Kafka's port free when looked at and bound by another process before Tansu binds it (two
    `rlrec broker`s started together): the broker takes a free port and says so, not exit 1."""
    from rlrec import cli
    from rlrec.commands import broker as broker_cmd

    log = tmp_path / "b.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        looks = iter([taken])  # the first look finds it free; later looks are real
        monkeypatch.setattr(broker_cmd, "default_port", lambda port=None: next(looks, None) or default_port(port))

        done = threading.Event()

        def stop_when_the_second_broker_answers() -> None:
            deadline = time.monotonic() + 60
            while not done.is_set() and time.monotonic() < deadline:
                text = log.read_text() if log.exists() else ""
                if text.count("=== rlrec LocalBroker start") >= 2:
                    port = int(text.rsplit("--listener-url tcp://127.0.0.1:", 1)[1].split()[0])
                    try:
                        wait_for_broker(f"127.0.0.1:{port}", timeout=20)
                    finally:
                        os.kill(os.getpid(), signal.SIGTERM)  # run()'s handler is installed by now
                    return
                done.wait(0.1)
            if not done.is_set():
                os.kill(os.getpid(), signal.SIGTERM)  # a run() that never started a second broker

        # what a SIGTERM that comes after run() restored its predecessor does: nothing
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        t = threading.Thread(target=stop_when_the_second_broker_answers, daemon=True)
        t.start()
        try:
            rc = cli.main(["broker", "--log-path", str(log)])
        finally:
            done.set()
            t.join(30)
            signal.signal(signal.SIGTERM, previous)
    out, err = capsys.readouterr()
    assert rc == 0, err
    bootstrap = out.splitlines()[0]
    assert bootstrap.startswith("bootstrap_servers=127.0.0.1:") and bootstrap != f"bootstrap_servers=127.0.0.1:{taken}"
    assert f"port {taken} was taken while starting: listening on a free port" in err
