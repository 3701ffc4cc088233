"""Poison pills on a one-partition topic: no message can crash, stall or wedge the consumer.

Every case is followed by a good episode on the same (only) partition. One consumer process
reads it all: it must stay up, commit every good episode exactly once, dead-letter each poison
message with its reason (whole episodes where the episode is spoiled), write nothing outside its
output root, and hold memory within its byte budgets. Each case names the failure it guards
against. The hostile messages of tests/test_hostile.py run
here too, one by one between good episodes.
"""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

from rlrec.consumer.assembly import CONSUMER_REASONS
from rlrec.consumer.topics import create_topics, dlq_topic_name
from rlrec.producer import EpisodeRecorder
from rlrec.producer.events import DECODE_REASONS, SCHEMA_HEADER, schema_header
from rlrec.store.storage import Storage
from tests.helpers import ACT_SPACE, OBS_SPACE, assert_episode_matches, record_episodes, wait_for
from tests.test_consumer_e2e import committed_episodes, drain_dlq, read_all, run_consumer
from tests.test_hostile import HostileTopic, _arr, _hostile_messages, raw, start_rec, steps_rec

pytestmark = [pytest.mark.broker, pytest.mark.slow]

MAX_EPISODE_BYTES = 4 * 1024 * 1024
MAX_MESSAGE_BYTES = 2_000_000


@pytest.fixture
def one_partition_topic(broker) -> str:
    name = f"poison-{uuid.uuid4().hex[:10]}"
    create_topics(broker.bootstrap_servers, {name: 1, dlq_topic_name(name): 1})
    return name


def _episode(eid: str, reason: str, *bad_batches: dict, after: int = 1, **start_over) -> list:
    """A start, one good batch (t=0..1), the bad batch(es), then `after` more batches: all of them
    dead-lettered with `reason` (the episode is spoiled as a whole)."""
    msgs = [
        (f"{eid} start", eid.encode(), *raw("EpisodeStart", start_rec(eid, **start_over)), reason),
        (f"{eid} steps 0-1", eid.encode(), *raw("StepBatch", steps_rec(eid, 0, 2)), reason),
    ]
    msgs += [(f"{eid} bad {i}", eid.encode(), *raw("StepBatch", b), reason) for i, b in enumerate(bad_batches)]
    t = 2 + sum(len(b["rewards"]["data"]) // 8 for b in bad_batches)
    for i in range(after):
        last = i == after - 1
        msgs.append((f"{eid} after", eid.encode(), *raw("StepBatch", steps_rec(eid, t, 1, terminated=last)), reason))
        t += 1
    return msgs


def _single(eid: str, reason: str, bad: dict) -> list:
    """A start, a good batch, the bad batch (one dead letter), then the episode goes on with a
    good batch at the same t and lands."""
    return [
        (f"{eid} start", eid.encode(), *raw("EpisodeStart", start_rec(eid)), None),
        (f"{eid} steps 0-1", eid.encode(), *raw("StepBatch", steps_rec(eid, 0, 2)), None),
        (f"{eid} bad", eid.encode(), *raw("StepBatch", bad), reason),
        (f"{eid} steps 2", eid.encode(), *raw("StepBatch", steps_rec(eid, 2, 1, terminated=True)), None),
    ]


def _poison_cases() -> list[tuple[str, str, list]]:
    """(name, the failure it guards against, messages). Episodes named `land-*` must land."""
    big_key = b"k" * 1_100_000
    big_headers = [("x-junk", b"j" * 600_000), ("x-junk2", b"j" * 500_000)]
    many_ints = json.dumps({"x": list(range(200_000))})  # ~1.4 MB of JSON, ~7 MB of Python objects
    wide_obs = np.zeros((36_000, 4), np.float32)  # ~576 KB per batch
    cases = [
        (
            "extra output changes trailing shape",
            "crash loop of the whole group: np.concatenate raised out of run() when the episode was built",
            _single(
                "land-extra-shape",
                "extra-output-mismatch",
                steps_rec(
                    "land-extra-shape", 2, 1, extra_model_outputs={"action_logp": _arr(np.zeros((1, 3), np.float32))}
                ),
            ),
        ),
        (
            "extra output changes dtype",
            "float32 and int64 batches were silently promoted to float64",
            _single(
                "land-extra-dtype",
                "extra-output-mismatch",
                steps_rec("land-extra-dtype", 2, 1, extra_model_outputs={"action_logp": _arr(np.zeros(1, np.int64))}),
            ),
        ),
        (
            "key over the DLQ producer's message.max.bytes",
            "produce() raised KafkaException (only BufferError was caught): crash loop",
            [("huge key", big_key, b"\0garbage", schema_header("StepBatch"), "key-too-large")],
        ),
        (
            "headers over the DLQ producer's message.max.bytes",
            "produce() raised KafkaException: crash loop",
            [("huge headers", b"hh", b"\0garbage", [*schema_header("StepBatch"), *big_headers], "malformed")],
        ),
        (
            "pre-set DLQ headers",
            "the DLQ appended its headers after the producer's: tools reading the first value were fooled",
            [
                (
                    "forged dlq headers",
                    b"forged",
                    b"\0garbage",
                    [
                        ("rlrec-dlq-reason", b"all-good"),
                        ("rlrec-source-offset", b"0"),
                        *schema_header("StepBatch"),
                    ],
                    "malformed",
                )
            ],
        ),
    ]
    for i, pid in enumerate(["../x", "/x", ".", "a//b", "x\0y", "p" * 300, "_manifest", "../../../../tmp/rlrec-pwn"]):
        cases.append(
            (
                f"policy id {pid[:20]!r}",
                "accepted; the flush failed on every retry (or wrote outside the output): the partition stalled",
                [
                    (
                        f"bad pid {i}",
                        f"pid{i}".encode(),
                        *raw("EpisodeStart", start_rec(f"pid{i}", policy_id=pid)),
                        "bad-policy-id",
                    )
                ],
            )
        )
    cases += [
        (
            "env id with control characters",
            "stored as given",
            [("bad env", b"env", *raw("EpisodeStart", start_rec("env", env_id="CartPole\x1b[31m")), "bad-env-id")],
        ),
        (
            "info integer >= 2**64",
            "msgpack could not pack it: every flush of the partition failed, forever",
            _single("land-info-int", "bad-info", steps_rec("land-info-int", 2, 1, infos=[json.dumps({"x": 2**64})])),
        ),
        (
            "info with a lone surrogate",
            "msgpack could not pack it: every flush of the partition failed, forever",
            _single("land-info-sur", "bad-info", steps_rec("land-info-sur", 2, 1, infos=['{"x": "\\ud800"}'])),
        ),
        (
            "action outside Discrete(2)",
            "stored; RLlib's TorchCategorical.logp raised 'index out of bounds' in the trainer",
            _episode("oos", "out-of-space", steps_rec("oos", 2, 1, actions=[_arr(np.array([7]))])),
        ),
        (
            "NaN observation",
            "stored and trained on",
            _episode(
                "nan-obs",
                "non-finite-value",
                steps_rec("nan-obs", 2, 1, observations=[_arr(np.full((1, 4), np.nan, np.float32))]),
            ),
        ),
        (
            "inf in the start observation",
            "stored and trained on",
            [
                (
                    "inf start",
                    b"inf-start",
                    *raw(
                        "EpisodeStart",
                        start_rec("inf-start", observation=[_arr(np.array([0, np.inf, 0, 0], np.float32))]),
                    ),
                    "non-finite-value",
                ),
                (
                    "inf start steps",
                    b"inf-start",
                    *raw("StepBatch", steps_rec("inf-start", 0, 1, terminated=True)),
                    "non-finite-value",
                ),
            ],
        ),
        (
            "one message whose info costs more memory than max_episode_bytes",
            "a 6 MB message held ~138 MiB while the episode was counted at ~1.2 KB",
            _episode("big-info", "episode-too-large", steps_rec("big-info", 2, 1, infos=[many_ints])),
        ),
        (
            "an endless episode",
            "open episodes were capped by count only: it grew without bound",
            _episode(
                "endless",
                "episode-too-large",
                *[
                    steps_rec(
                        "endless",
                        2 + i * len(wide_obs),
                        len(wide_obs),
                        observations=[_arr(wide_obs)],
                        actions=[_arr(np.zeros(len(wide_obs), np.int64))],
                        extra_model_outputs={"action_logp": _arr(np.zeros(len(wide_obs), np.float32))},
                    )
                    for i in range(8)
                ],
            ),
        ),
    ]
    return cases


def test_poison_pills_cost_one_dead_letter_each_and_nothing_else(
    broker, one_partition_topic, tmp_path, recorder_config
):
    topic = one_partition_topic
    marker = f"/tmp/rlrec-pwned-{uuid.uuid4().hex}"
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    cfg = recorder_config(
        output,
        topic=topic,
        max_message_bytes=MAX_MESSAGE_BYTES,
        dlq_max_message_bytes=100_000,
        max_episode_bytes=MAX_EPISODE_BYTES,
        reward_join_window_s=2.0,
    )
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    hostile = HostileTopic(broker.bootstrap_servers, topic)
    hostile.producer = type(hostile.producer)(
        {
            "bootstrap.servers": broker.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "message.max.bytes": 4_000_000,
        }
    )
    truth: dict = {}
    landing: set[str] = set()
    seed = 100
    # the hostile messages of test_hostile (oversize raised above the limit of this consumer)
    old = [
        (n, k, b"\0" * (MAX_MESSAGE_BYTES + 50_000) if n == "oversize" else v, h, r)
        for n, k, v, h, r in _hostile_messages(marker)
    ]
    cases = [("test_hostile message: " + m[0], "see tests/test_hostile.py", [m]) for m in old]
    cases += _poison_cases()
    for _name, _caught, msgs in cases:
        for m in msgs:
            hostile.send(*m)
            if m[0].startswith("land-") or m[1].decode(errors="replace").startswith("land-"):
                landing.add(m[1].decode())
        hostile.flush()
        truth.update(record_episodes(rec, 1, seed=seed))  # a good episode right after each case
        seed += 1
        assert rec.flush(10) == 0
    # test_hostile's episodes h-open (finished in its phase 2) and h-fin land too
    hostile.send("h-open steps 2-3", b"h-open", *raw("StepBatch", steps_rec("h-open", 2, 2, terminated=True)), None)
    hostile.flush()
    landing |= {"h-open", "h-fin"}

    c, t = run_consumer(cfg, storage)
    try:
        wait_for(
            lambda: committed_episodes(storage) >= len(truth) + len(landing),
            180,
            interval=0.5,
            what="every good episode committed",
        )
        # a delayed reward for an episode already committed is late, then one more good episode
        late = next(iter(truth))
        reward = {"episode_id": late, "t": 0, "reward": 1.0, "timestamp_ms": 1}
        hostile.send("late reward", late.encode(), *raw("RewardDelta", reward), "late-reward")
        hostile.flush()
        truth.update(record_episodes(rec, 1, seed=seed))
        assert rec.flush(10) == 0
        wait_for(lambda: committed_episodes(storage) >= len(truth) + len(landing), 60, what="the last episode")
        n_expected = len(hostile.expected) + 1  # + h-empty's start (empty-episode)
        wait_for(
            lambda: (
                len(c.dlq.pending) == 0
                and sum(
                    s.value for m in c.metrics.dead_letters.collect() for s in m.samples if s.name.endswith("_total")
                )
                >= n_expected
            ),
            60,
            what="every dead letter acknowledged",
        )
        assert t.is_alive() and not c._stop.is_set(), "the consumer exited"
    finally:
        c.stop()
        t.join(30)
        rec.close()
    assert not t.is_alive()

    # every dead letter: its reason, its source offset; nothing more, nothing less
    expected = dict(hostile.expected)
    expected[hostile.offsets["h-empty start"]] = "empty-episode"
    got: dict[tuple[int, int], str] = {}
    for m in drain_dlq(broker.bootstrap_servers, topic, 4):
        h = m.headers()
        own = [k for k, _ in h if k.startswith(("rlrec-dlq-", "rlrec-source-"))]
        assert sorted(own) == sorted(
            [
                "rlrec-dlq-reason",
                "rlrec-dlq-detail",
                "rlrec-source-topic",
                "rlrec-source-partition",
                "rlrec-source-offset",
            ]
        ), own  # the producer's forged ones were renamed original-rlrec-*
        hd = dict(h)
        where = (int(hd["rlrec-source-partition"]), int(hd["rlrec-source-offset"]))
        assert where not in got, f"two dead letters for {hostile.names.get(where)}"
        got[where] = hd["rlrec-dlq-reason"].decode()
        name = hostile.names.get(where, "")
        if name == "huge key":
            assert len(m.key()) == 1024 and int(hd["rlrec-original-key-length"]) == 1_100_000
        if name == "huge headers":
            assert int(hd["rlrec-original-headers-length"]) > 1_100_000 and "x-junk" not in hd
        if name == "forged dlq headers":
            assert hd["original-rlrec-dlq-reason"] == b"all-good" and hd["rlrec-dlq-reason"] == b"malformed"
        assert sum(len(k) + len(v or b"") for k, v in h) < 4096  # headers capped whatever came in
    wrong = {hostile.names.get(w, w): (got.get(w), r) for w, r in expected.items() if got.get(w) != r}
    assert not wrong, f"(got, expected) dead-letter reasons: {wrong}"
    assert set(got) == set(expected), f"unexpected: {[hostile.names.get(w, w) for w in set(got) - set(expected)]}"
    # every reason is exercised here except those with suites of their own: timeouts and capacity
    # (tests/test_memory_bound.py, test_consumer_faults.py), unwritable (test_unwritable_episode_*
    # below), internal (tests/test_assembly.py: only a bug can raise it), partition-change
    # (tests/test_assembly.py; end to end on Apache Kafka only: Tansu has no CreatePartitions);
    # unknown-agent and out-of-order come from folding multi-agent episodes
    # (tests/test_multi_agent_refusals.py, tests/test_multi_agent_consumer.py); kind-mismatch and
    # id-collision from mixing the two kinds (tests/test_multi_agent_replay_rules.py)
    multi_agent = {"kind-mismatch", "id-collision"}
    assert set(expected.values()) == (set(DECODE_REASONS) - {"unknown-agent", "out-of-order"}) | (
        set(CONSUMER_REASONS) - {"timeout", "capacity", "unwritable", "internal", "partition-change"} - multi_agent
    )

    assert not os.path.exists(marker), "a pickle payload was executed"
    assert not os.path.exists("/tmp/rlrec-pwn") and sorted(os.listdir(tmp_path)) == ["out"]
    assert {p.split("/")[0] for p in (i.path for i in storage.list(""))} <= {
        "pol",
        "_manifest",
        "_owners",
    }  # _owners: the consumer's owner leases
    got_eps = read_all(storage)  # asserts that no episode is in two shards
    assert set(got_eps) == set(truth) | landing
    for eid, ep in truth.items():
        assert_episode_matches(got_eps[eid][0], ep)
    for eid in landing - {"h-open", "h-fin"}:  # the bad batch was left out, the episode is whole
        assert len(got_eps[eid][0]) == 3, eid


def test_unwritable_episode_is_dead_lettered_and_its_shard_mates_land(
    broker, one_partition_topic, tmp_path, recorder_config
):
    """An extra model output named `obs` cannot be a tabular column (RLlib reserves the name):
    the flush is not retried forever (the partition would stall): the episode is dead-lettered
    `unwritable` (its events re-encoded) and the others of the same flush land."""
    topic = one_partition_topic
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    hostile = HostileTopic(broker.bootstrap_servers, topic)
    msgs = [
        ("bad start", b"bad", *raw("EpisodeStart", start_rec("bad")), "unwritable"),
        (
            "bad steps",
            b"bad",
            *raw(
                "StepBatch",
                steps_rec("bad", 0, 2, terminated=True, extra_model_outputs={"obs": _arr(np.zeros(2, np.float32))}),
            ),
            "unwritable",
        ),
    ]
    good = []
    for i in range(3):
        eid = f"good{i}"
        good.append(eid)
        msgs += [
            (f"{eid} start", eid.encode(), *raw("EpisodeStart", start_rec(eid)), None),
            (f"{eid} steps", eid.encode(), *raw("StepBatch", steps_rec(eid, 0, 3, terminated=True)), None),
        ]
    for m in msgs:
        hostile.send(*m)
    hostile.flush()
    cfg = recorder_config(output, topic=topic, format="tabular", max_file_age_s=0.5)
    c, t = run_consumer(cfg, storage)
    try:
        wait_for(lambda: committed_episodes(storage) >= 3, 60, what="the good episodes committed")
        wait_for(lambda: not c.dlq.pending and c.dlq.delivered >= 2, 30, what="the bad episode dead-lettered")
        assert t.is_alive()
    finally:
        c.stop()
        t.join(30)
    letters = drain_dlq(broker.bootstrap_servers, topic, 4)
    got = sorted(
        (int(dict(m.headers())["rlrec-source-offset"]), dict(m.headers())["rlrec-dlq-reason"].decode()) for m in letters
    )
    # both records (the start, the steps) at the start's offset: until both are acknowledged the
    # commit stays before the episode's first event
    assert got == [(hostile.offsets["bad start"][1], "unwritable")] * 2
    assert all(dict(m.headers())[SCHEMA_HEADER] for m in letters)  # re-encoded events: decodable
