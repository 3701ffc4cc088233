"""The consumer's CPU per agent step on multi-agent episodes (PettingZoo simple_spread).

    python bench/multi_agent_consumer.py [--episodes E] [--rounds R] [--json PATH]

The messages: E episodes of simple_spread (mpe2, 3 agents, 25 cycles, random actions, one
``action_logp`` per acting agent; agents mapped to two modules, so each episode's rows are two
shards' worth) recorded once through `EpisodeRecorder.begin_multi_agent_episode` /
`log_multi_agent_step` to a 4-partition topic of an embedded Tansu broker and read back once
(values, headers, offsets) before any clock starts. Each round runs, in this process, alternating
which goes first:

* ``assemble``: what the consumer does per message -- `decode_event`, a `PartitionAssembler` per
  partition (`apply`), and at each episode's end the fold, the fast split (RLlib's replay where it
  does not apply) and the agent rows (`ready`) -- with no write;
* ``assemble+commit``: the same, then every partition's rows committed through a
  `ShardCommitter` (version-2 shards, zstd, the manifest log) to a fresh local directory with
  rlrec's default durability (fsync).

Not counted: the Kafka client's polling (the same per byte for single- and multi-agent messages:
`bench/consumer.py` measures it), offset commits, dead-letter production. Figures: process CPU µs
per agent step (agent steps = the rows' lengths summed), median over the rounds after one
warm-up, with min-max. Needs ``pip install "pettingzoo==1.27.*" "mpe2==1.1.*"``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rlrec.consumer.assembly import PartitionAssembler
from rlrec.producer.multi_agent_events import decode_event
from rlrec.store.commit import ShardCommitter
from rlrec.store.storage import Storage


def _assemble(messages: list, topic: str) -> dict:
    parts: dict[int, PartitionAssembler] = {}
    rows: dict[int, list] = {}
    for p, offset, value, headers, key in messages:
        a = parts.get(p) or parts.setdefault(p, PartitionAssembler(topic, p))
        letters = a.apply(offset, decode_event(value, headers, key=key), now=0.0)
        assert not letters, letters
    for p, a in parts.items():
        rows[p] = a.ready(force=True)
    return rows


def _commit(messages: list, topic: str) -> int:
    rows = _assemble(messages, topic)
    root = tempfile.mkdtemp(prefix="rlrec-bench-ma-")
    try:
        n = 0
        for p, r in rows.items():
            n += ShardCommitter(Storage.from_uri(root), topic, p).commit(r).episodes
        return n
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from rlrec.consumer.topics import create_topics
    from rlrec.local import LocalBroker
    from tests.multi_agent_cases import simple_spread
    from tests.multi_agent_consume import send_all
    from tests.test_recorder import read_messages

    recs = []
    for i in range(a.episodes):
        rec = simple_spread(f"spread-{i}", seed=i)
        rec.agent_modules = {"agent_0": "a", "agent_1": "b", "agent_2": "b"}
        recs.append(rec)
    broker = LocalBroker("memory").start()
    try:
        topic = "bench-ma"
        create_topics(broker.bootstrap_servers, {topic: 4})
        n = send_all(broker.bootstrap_servers, topic, recs)
        messages = [
            (m.partition(), m.offset(), m.value(), m.headers(), m.key())
            for m in read_messages(broker.bootstrap_servers, topic, n, timeout=60)
        ]
    finally:
        broker.stop()
    rows = [r for rs in _assemble(messages, topic).values() for r in rs]
    agent_steps = sum(r.length for r in rows)
    sides = {"assemble": lambda: _assemble(messages, topic), "assemble+commit": lambda: _commit(messages, topic)}
    names = list(sides)
    per: dict[str, list[float]] = {s: [] for s in names}
    for rnd in range(a.rounds + 1):
        for s in names if rnd % 2 == 0 else names[::-1]:
            t0 = time.process_time()
            sides[s]()
            us = (time.process_time() - t0) * 1e6 / agent_steps
            if rnd:  # round 0 warms up
                per[s].append(us)
    out = {
        "episodes": a.episodes,
        "messages": len(messages),
        "agent_rows": len(rows),
        "agent_steps_per_round": agent_steps,
        "rounds": a.rounds,
    }
    for s in names:
        out[s] = {
            "median_us": statistics.median(per[s]),
            "min_us": min(per[s]),
            "max_us": max(per[s]),
            "rounds": per[s],
        }
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"{k:>22}: " + "  ".join(f"{m}={x:.2f}" for m, x in v.items() if m != "rounds"))
        else:
            print(f"{k:>22}: {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
