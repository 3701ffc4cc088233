"""``rlrec broker``: run a local Tansu broker (and, with s3 storage, a local S3) in the foreground."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from rlrec.options import OptionSet, option


@dataclass
class BrokerOptions:
    """Options of `rlrec broker`."""

    port: int | None = option(
        None, help="listen port (default: 9092, Kafka's, when it is free on 127.0.0.1, else a free one, said on stderr)"
    )
    storage: Literal["memory", "s3"] = option("memory", help="memory, or s3 (a local moto S3 in this process)")
    log_path: str | None = option(None, help="broker log file (default: a temp file)")
    startup_timeout: float = option(20.0, help="seconds to wait for the broker")


#: the options of `rlrec broker`
OPTIONS = OptionSet("broker", BrokerOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "broker",
        help="run a local Kafka-protocol broker (Tansu) until SIGINT/SIGTERM",
        description="Run a local Tansu broker on 127.0.0.1 in the foreground. Prints "
        "'bootstrap_servers=127.0.0.1:PORT' as the first line on stdout (then other "
        "key=value lines) and runs until SIGINT or SIGTERM. With --storage s3 the "
        "broker keeps its data in a local S3 server (moto) run by this process, so "
        "it survives broker restarts but not the end of this command.",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


#: Kafka's port, the one `rlrec broker` takes when it is free (snippets say kafka:9092)
KAFKA_PORT = 9092


def default_port(preferred: int = KAFKA_PORT, host: str = "127.0.0.1") -> int | None:
    """`preferred` when it can be bound on `host` now, else None (the broker takes a free one).

    Example:
        >>> import socket
        >>> with socket.socket() as s:
        ...     s.bind(("127.0.0.1", 0)); s.listen()
        ...     taken = s.getsockname()[1]
        ...     default_port(taken) != taken
        True
    """
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, preferred))
        except OSError:
            return None
    return preferred


def run(args: argparse.Namespace) -> int:
    import signal
    import sys
    import threading

    from rlrec.local import BrokerStartError, LocalBroker

    opts = OPTIONS.build(BrokerOptions, OPTIONS.resolve(args))  # OptionError: one line, exit 2

    stop = threading.Event()
    received: list[int] = []

    def _on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    port = opts.port
    if port is None:
        port = default_port()
        if port is None:
            print(f"rlrec broker: port {KAFKA_PORT} is taken: listening on a free port", file=sys.stderr)
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def new_broker(port: int | None) -> LocalBroker:
        return LocalBroker(opts.storage, port=port, log_path=opts.log_path, startup_timeout=opts.startup_timeout)

    broker = new_broker(port)
    try:
        try:
            try:
                broker.start()
            except BrokerStartError:
                # Kafka's port, free when looked at, taken by the time the broker bound it
                if opts.port is not None or port is None or default_port(port) is not None:
                    raise
                print(f"rlrec broker: port {port} was taken while starting: listening on a free port", file=sys.stderr)
                broker.stop()
                broker = new_broker(None)
                broker.start()
        except BrokerStartError as e:
            print(f"rlrec broker: {e}", file=sys.stderr)
            return 1
        print(f"bootstrap_servers={broker.bootstrap_servers}")
        if broker.s3 is not None:
            print(f"s3_endpoint_url={broker.s3.endpoint_url}")
            print(f"s3_bucket={broker.bucket}")
        print(f"log_path={broker.log_path}")
        sys.stdout.flush()
        print(f"rlrec broker: ready ({broker.storage_url}); stop with Ctrl-C or SIGTERM", file=sys.stderr)
        while not stop.wait(0.5):
            if not broker.running:
                print(
                    f"rlrec broker: the broker exited unexpectedly; last log lines:\n{broker.log_tail()}",
                    file=sys.stderr,
                )
                return 1
        print(f"rlrec broker: signal {received[0]} received, stopping", file=sys.stderr)
        return 0
    finally:
        broker.stop()
        for s, h in previous.items():
            signal.signal(s, h)
