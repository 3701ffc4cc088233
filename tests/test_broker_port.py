"""`rlrec broker` listens on Kafka's port 9092 when it is free (so `kafka:9092` snippets need only
the host changed), else on a free port, and says so."""

from __future__ import annotations

import socket

from rlrec.commands.broker import KAFKA_PORT, default_port


def test_the_preferred_port_when_free_else_a_free_one():
    assert KAFKA_PORT == 9092
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert default_port(taken) is None
    assert default_port(taken) == taken  # closed again: free
