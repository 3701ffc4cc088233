"""The recorder under a hostile caller and a busy service: threads, signals, finalizers, close().

Each test states what it checks; all of them end by checking the accounting: after close(),
nothing is buffered and every record is delivered, failed or dropped. A recorder that hangs
fails the test through a bounded join (the hung threads are daemons), never by hanging pytest.
Most tests use a stand-in producer whose deliveries the test controls; the stress test at the
end runs against the real broker.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import uuid
from collections import defaultdict

import numpy as np
import pytest
from gymnasium import spaces as gs

from rlrec.producer import EpisodeRecorder, RecorderClosed, RecorderReentryError
from rlrec.producer import recorder as recorder_module
from rlrec.producer.events import EpisodeAbort, EpisodeStart, RewardDelta, StepBatch, decode

NOWHERE = "127.0.0.1:1"
OBS = gs.Box(-np.inf, np.inf, (3,), np.float32)
ACT = gs.Discrete(3)
WAIT = 10.0  # seconds any single call may take before the test calls it hung


class _StandInProducer:
    """Stands in for confluent_kafka.Producer: keeps every message; delivers pending ones when
    polled while `gate` is set, and on flush() (after `flush_delay` s, like a slow network)."""

    def __init__(self, deliver: bool = True, flush_delay: float = 0.0):
        self.lock = threading.Lock()
        self.messages: list[tuple[bytes, bytes, list]] = []
        self.pending: list = []
        self.gate = threading.Event()
        if deliver:
            self.gate.set()
        self.flush_delay = flush_delay

    def produce(self, topic, value, key=None, headers=None, on_delivery=None):
        with self.lock:
            self.messages.append((key, value, headers))
            self.pending.append(on_delivery)

    def _deliver(self) -> int:
        with self.lock:
            pending, self.pending = self.pending, []
        for cb in pending:
            cb(None, None)
        return len(pending)

    def poll(self, timeout=0):
        if not self.gate.is_set():
            time.sleep(min(timeout or 0, 0.01))
            return 0
        n = self._deliver()
        if not n and timeout:
            time.sleep(min(timeout, 0.002))
        return n

    def flush(self, timeout=-1):
        time.sleep(self.flush_delay)
        self._deliver()
        return 0

    def purge(self):
        pass

    def __len__(self):
        with self.lock:
            return len(self.pending)

    def decoded(self) -> list:
        with self.lock:
            return [decode(v, h) for _, v, h in self.messages]


def _recorder(**kw) -> tuple[EpisodeRecorder, _StandInProducer]:
    deliver, flush_delay = kw.pop("deliver", True), kw.pop("flush_delay", 0.0)
    kw.setdefault("observation_space", OBS)
    kw.setdefault("action_space", ACT)
    rec = EpisodeRecorder(NOWHERE, "t", kafka_config={"log_level": 0}, **kw)
    real, fake = rec._producer, _StandInProducer(deliver, flush_delay)
    rec._producer = fake
    real.purge()
    return rec, fake


def _records(events: list) -> int:
    """Records carried by these events (one per begin, step, reward and abort)."""
    return sum(e.n if isinstance(e, StepBatch) else 1 for e in events)


def _in_thread(fn, timeout: float = WAIT):
    """fn() on a daemon thread: (finished, result or exception)."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # handed to the test
            out.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    return (not th.is_alive()), (out[0] if out else None)


def _close_and_check(rec: EpisodeRecorder) -> None:
    done, result = _in_thread(lambda: rec.close(5))
    assert done, "close() hung"
    assert not isinstance(result, BaseException), result
    st = rec.stats
    assert st.buffered == 0, st
    assert st.produced == st.delivered + st.failed, st


def _obs(v: float = 0.0) -> np.ndarray:
    return np.full(3, v, np.float32)


# ---------------------------------------------------- 1. a waiting log_step re-checks its episode


@pytest.mark.parametrize("how", ["abort", "close"])
def test_a_step_waiting_for_room_raises_when_its_episode_is_aborted_or_the_recorder_closed(how):
    # the buffer is full (on_overflow="block"); while a log_step waits for room, another thread
    # aborts its episode (or closes the recorder) and room frees up: the waiting call must
    # raise, not append to the dead episode and return OK
    rec, fake = _recorder(deliver=False, max_buffered_steps=2, max_batch_delay_s=3600)
    eid = rec.begin_episode(_obs())
    rec.log_step(eid, 0, 1.0, _obs(1))  # 2 records: full
    started = threading.Event()

    def waiting_step():
        started.set()
        rec.log_step(eid, 1, 1.0, _obs(2), terminated=True)

    th_done: list = []
    th = threading.Thread(target=lambda: th_done.append(_in_thread(waiting_step, 30)), daemon=True)
    th.start()
    started.wait(5)
    time.sleep(0.3)  # it is waiting for room now
    assert th.is_alive()
    if how == "abort":
        rec.abort_episode(eid, "another thread")
        fake.gate.set()  # deliveries free the room the step waits for
    else:
        _close_and_check(rec)
    th.join(WAIT)
    assert th_done, "the waiting log_step never returned"
    finished, result = th_done[0]
    assert finished
    if how == "abort":
        assert isinstance(result, ValueError) and "aborted" in str(result), result
    else:
        assert isinstance(result, RecorderClosed), result
    _close_and_check(rec)
    events = [e for e in fake.decoded() if e.episode_id == eid]
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["EpisodeStart", "StepBatch", "EpisodeAbort"], kinds  # nothing after the abort
    assert rec.stats.delivered == _records(events) == 3


def test_a_full_librdkafka_queue_is_waited_out_without_losing_steps():
    # produce() raises BufferError until deliveries free librdkafka's queue; the recorder waits
    # for it with its lock held, so no other thread can end the episode in between
    rec, fake = _recorder(max_batch_steps=2, max_batch_delay_s=3600)
    real_produce, refusals = fake.produce, [3]

    def produce(*a, **kw):
        if refusals[0]:
            refusals[0] -= 1
            raise BufferError("queue full")
        real_produce(*a, **kw)

    fake.produce = produce
    eid = rec.begin_episode(_obs())
    for t in range(6):
        rec.log_step(eid, t % 3, 1.0, _obs(t), terminated=t == 5)
    _close_and_check(rec)
    assert rec.stats.delivered == 7 and rec.stats.failed == 0
    assert [e.t0 for e in fake.decoded() if isinstance(e, StepBatch)] == [0, 2, 4]


# -------------------------------------------------------------- 2. close() racing with threads


def test_close_refuses_new_records_and_sends_every_accepted_one():
    # threads keep beginning episodes and logging steps while close() runs (its flush is slow,
    # as on a real network): every call that returned normally must be delivered, and every
    # call after close() began must raise RecorderClosed
    rec, fake = _recorder(flush_delay=0.3, max_batch_steps=8)
    accepted = [0] * 6
    refused = [0] * 6
    stop = threading.Event()

    def worker(w: int) -> None:
        while not stop.is_set():
            try:
                eid = rec.begin_episode(_obs(w))
                accepted[w] += 1
                for t in range(20):
                    rec.log_step(eid, t % 3, 1.0, _obs(t))
                    accepted[w] += 1
            except RuntimeError:  # RecorderClosed (a RuntimeError)
                refused[w] += 1
                time.sleep(0.001)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(len(accepted))]
    for th in threads:
        th.start()
    time.sleep(0.2)
    _close_and_check(rec)
    closed_at = sum(accepted)
    time.sleep(0.2)
    stop.set()
    for th in threads:
        th.join(WAIT)
    assert sum(accepted) == closed_at, "records were accepted after close() returned"
    assert sum(refused) > 0
    st = rec.stats
    assert st.failed == 0 and st.dropped == 0
    # accepted begins + steps, plus one "recorder-closed" abort per episode left open
    aborts = sum(isinstance(e, EpisodeAbort) for e in fake.decoded())
    assert st.delivered == sum(accepted) + aborts == _records(fake.decoded()), st
    assert rec.open_episodes == 0


# -------------------------------------------------- 3. signal handlers raising inside the recorder


class _Interrupt(Exception):
    pass


@pytest.mark.skipif(sys.platform == "win32", reason="signal.pthread_kill")
def test_exceptions_from_signal_handlers_never_leave_the_lock_held():
    # a SIGUSR1 handler raises while the main thread logs, begins, aborts and reads stats
    # (other threads log too): >= 1,000 deliveries, then the recorder must still answer from
    # any thread and close with its accounting adding up
    rec, fake = _recorder(max_batch_steps=16)
    inside = os.path.dirname(recorder_module.__file__)  # the recorder and the helpers it calls
    handled, raised = [0], [0]
    finished, main_done = threading.Event(), threading.Event()

    def handler(signum, frame):
        # raises where the recorder's code runs (the test's own loop must not be torn apart)
        handled[0] += 1
        if frame is not None and frame.f_code.co_filename.startswith(inside):
            raised[0] += 1
            raise _Interrupt

    def other_thread(w: int) -> None:
        while not finished.is_set():
            try:
                eid = rec.begin_episode(_obs(w))
                for t in range(50):
                    rec.log_step(eid, t % 3, 1.0, _obs(t), truncated=t == 49)
            except RuntimeError:
                return

    main = threading.main_thread().ident
    assert threading.get_ident() == main

    def sender() -> None:
        deadline = time.monotonic() + 60
        while not main_done.is_set() and time.monotonic() < deadline:
            if raised[0] >= 1_000:
                finished.set()  # from now on only to wake the main thread should it be stuck
            before = handled[0]
            signal.pthread_kill(main, signal.SIGUSR1)
            until = time.monotonic() + (0.05 if finished.is_set() else 0.02)
            while handled[0] == before and time.monotonic() < until:
                time.sleep(0.0002)
        finished.set()

    old = signal.signal(signal.SIGUSR1, handler)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # the main thread gets the GIL back soon: signals are handled sooner
    others = [threading.Thread(target=other_thread, args=(w,), daemon=True) for w in range(2)]
    send = threading.Thread(target=sender, daemon=True)
    try:
        for th in others:
            th.start()
        send.start()
        eid = None
        i = 0
        while not finished.is_set():
            i += 1
            try:
                if eid is None:
                    eid = rec.begin_episode(_obs(i))
                rec.log_step(eid, i % 3, 1.0, _obs(i), extra_model_outputs={"logp": np.float32(-1)})
                if i % 97 == 0:
                    rec.abort_episode(eid, "interrupted")
                    eid = None
                if i % 31 == 0:
                    rec.stats  # noqa: B018 - takes the lock
            except _Interrupt:
                pass
            except ValueError:  # an interrupted begin/abort left this id open or closed: start over
                eid = None
    finally:
        main_done.set()
        signal.signal(signal.SIGUSR1, old)
        sys.setswitchinterval(switch)
    send.join(WAIT)
    print("signals", handled[0], raised[0], i)
    assert raised[0] >= 1_000, (handled[0], raised[0])
    # the lock is free: another thread gets stats, logs a whole episode, and closes
    done, _ = _in_thread(lambda: rec.stats)
    assert done, "stats hung: a lock was left held"

    def one_episode():
        e = rec.begin_episode(_obs())
        rec.log_step(e, 0, 1.0, _obs(), terminated=True)

    done, result = _in_thread(one_episode)
    assert done and result is None, result
    for th in others:
        th.join(WAIT)
    _close_and_check(rec)
    assert rec.stats.delivered == _records(fake.decoded())


# ------------------------------------------------------------ 4. finalizers calling the recorder


def test_a_finalizer_calling_the_recorder_mid_call_neither_deadlocks_nor_corrupts():
    # a gc callback (as a __del__ of an orphaned episode would) aborts an episode and reads
    # stats; collections are forced to run at nearly every allocation, so many of them land
    # while this thread is inside the recorder: the call raises RecorderReentryError there
    # (stats works), and works when the thread is outside. Once every orphan is aborted (the
    # first 200 collections may all land outside a recorder call) the hook goes on calling
    # with an id that is not open, so collections inside the recorder are still met
    rec, fake = _recorder(max_batch_steps=8)
    orphans = [rec.begin_episode(_obs()) for _ in range(200)]
    outcomes: dict[str, int] = defaultdict(int)
    inside = [True]

    def on_gc(phase, info):
        if phase != "start" or not inside[0]:
            return
        try:
            rec.stats  # noqa: B018 - must work anywhere
            if orphans:
                rec.abort_episode(orphans[-1], "orphaned")
                orphans.pop()
                outcomes["worked"] += 1
            else:  # every orphan aborted: go on probing with an id that is not open
                try:
                    rec.abort_episode("never-begun", "orphaned")
                except ValueError:
                    outcomes["probed"] += 1
        except RecorderReentryError:
            outcomes["reentry"] += 1
        except BaseException as e:  # any other outcome fails the test
            outcomes[type(e).__name__] += 1

    def run():
        eid = rec.begin_episode(_obs())
        for t in range(3_000):
            rec.log_step(eid, t % 3, 1.0, _obs(t), info={"t": t}, extra_model_outputs={"v": [float(t)]})
        rec.log_step(eid, 0, 1.0, _obs(), terminated=True, extra_model_outputs={"v": [0.0]})

    threshold = gc.get_threshold()
    gc.callbacks.append(on_gc)
    gc.set_threshold(1)
    try:
        done, result = _in_thread(run, 60)
    finally:
        inside[0] = False
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_gc)
    assert done, f"deadlock: a finalizer re-entered the recorder ({dict(outcomes)})"
    assert result is None, result
    assert set(outcomes) <= {"worked", "probed", "reentry"}, dict(outcomes)
    assert outcomes["reentry"] > 0 and outcomes["worked"] > 0, dict(outcomes)
    _close_and_check(rec)
    events = fake.decoded()
    assert rec.stats.delivered == _records(events)
    reasons = [e.reason for e in events if isinstance(e, EpisodeAbort)]
    assert reasons.count("orphaned") == outcomes["worked"]
    assert reasons.count("recorder-closed") == len(orphans)


# ----------------------------------------------------------- 5. the caller may reuse its arrays


def test_arrays_may_be_changed_right_after_the_call():
    # one observation buffer, action array and output array reused for every step (as a
    # vectorized env or an inference server does): each step records the values of its call
    space = gs.Dict({"pos": gs.Box(-10, 10, (2,), np.float32), "img": gs.Box(0, 255, (2, 2), np.uint8)})
    rec, fake = _recorder(observation_space=gs.Box(-10, 10, (3,), np.float32), action_space=gs.Box(-1, 1, (2,)))
    rec2, fake2 = _recorder(observation_space=space, action_space=ACT)
    obs, act, dist = np.zeros(3, np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32)
    pos, img = np.zeros(2, np.float32), np.zeros((2, 2), np.uint8)
    eid = rec.begin_episode(obs)
    eid2 = rec2.begin_episode({"pos": pos, "img": img})
    n = 10
    for t in range(n):
        obs[:] = t
        act[:] = t / 10
        dist[:] = -t
        pos[:] = t
        img[:] = t
        rec.log_step(eid, act, 1.0, obs, terminated=t == n - 1, extra_model_outputs={"dist": dist})
        rec2.log_step(eid2, t % 3, 1.0, {"pos": pos, "img": img}, terminated=t == n - 1)
        for a in (obs, act, dist, pos, img):  # scribbled over before the batch is sent
            a[...] = 99
    _close_and_check(rec)
    _close_and_check(rec2)
    (batch,) = [e for e in fake.decoded() if isinstance(e, StepBatch)]
    np.testing.assert_array_equal(batch.observations[0], np.repeat(np.arange(n, dtype=np.float32), 3).reshape(n, 3))
    np.testing.assert_array_equal(batch.actions[0], np.repeat(np.arange(n, dtype=np.float32) / 10, 2).reshape(n, 2))
    np.testing.assert_array_equal(batch.extra_model_outputs["dist"], -np.repeat(np.arange(n), 2).reshape(n, 2))
    (batch2,) = [e for e in fake2.decoded() if isinstance(e, StepBatch)]
    pos_col, img_col = (batch2.observations[i] for i in range(2))
    assert sorted([pos_col.shape, img_col.shape]) == sorted([(n, 2), (n, 2, 2)])
    for col in (pos_col, img_col):
        np.testing.assert_array_equal(col.reshape(n, -1), np.repeat(np.arange(n), col[0].size).reshape(n, -1))


# ------------------------------------------------------------- stress against the real broker


@pytest.mark.broker
def test_stress_threads_logging_aborting_and_closing_deliver_what_stats_says(broker, topic):
    # 8 threads begin, log (some with delayed rewards), abort and end episodes with a small
    # buffer (on_overflow="block": they wait for each other's deliveries), then close() lands
    # in the middle of it. What a plain consumer reads back is exactly what stats says was
    # delivered, each episode's events in order and nothing after its end.
    from tests.test_recorder import read_messages

    rec = EpisodeRecorder(
        broker.bootstrap_servers,
        topic,
        observation_space=OBS,
        action_space=ACT,
        max_buffered_steps=64,
        max_batch_steps=16,
        max_batch_delay_s=0.05,
    )
    accepted = [0] * 8
    stop = threading.Event()
    rng_seed = uuid.uuid4().int % 1000

    def worker(w: int) -> None:
        rng = np.random.default_rng(rng_seed + w)
        obs = np.zeros(3, np.float32)
        try:
            while not stop.is_set():
                eid = rec.begin_episode(obs)
                accepted[w] += 1
                n = int(rng.integers(1, 60))
                for t in range(n):
                    obs[:] = t
                    done = t == n - 1 and rng.random() < 0.7
                    rec.log_step(eid, t % 3, 1.0, obs, terminated=done)
                    accepted[w] += 1
                    if t and rng.random() < 0.05:
                        # a record of its own (RewardDelta) only once its step was sent
                        rec.log_reward(eid, int(rng.integers(0, t)), 0.5)
                    if done:
                        break
                else:
                    rec.abort_episode(eid, "stress")
                    accepted[w] += 1
        except RecorderClosed:
            return
        except ValueError as e:  # an episode ended by close() between two calls of this thread
            assert "not open" in str(e) or "aborted" in str(e), e
            return

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(len(accepted))]
    for th in threads:
        th.start()
    time.sleep(1.5)
    done, left = _in_thread(lambda: rec.close(60), 90)  # close returns once all is delivered
    assert done and left == 0, left
    stop.set()
    for th in threads:
        th.join(WAIT)
        assert not th.is_alive()
    st = rec.stats
    assert st.buffered == 0 and st.failed == 0 and st.dropped == 0, st
    msgs = read_messages(broker.bootstrap_servers, topic, st.messages_delivered)
    assert len(msgs) == st.messages_delivered
    events: dict[str, list] = defaultdict(list)
    for m in msgs:
        e = decode(m.value(), m.headers())
        assert m.key() == e.episode_id.encode()
        events[e.episode_id].append(e)
    assert sum(_records(evs) for evs in events.values()) == st.delivered
    closes = sum(isinstance(e, EpisodeAbort) and e.reason == "recorder-closed" for v in events.values() for e in v)
    deltas = sum(isinstance(e, RewardDelta) for v in events.values() for e in v)
    assert st.delivered == sum(accepted) + closes + deltas, (st, sum(accepted), closes, deltas)
    assert len(events) == st.episodes_begun
    for eid, evs in events.items():
        assert isinstance(evs[0], EpisodeStart), eid
        t = 0
        ended = False
        for e in evs[1:]:
            assert not ended or isinstance(e, RewardDelta), (eid, [type(x).__name__ for x in evs])
            if isinstance(e, StepBatch):
                assert e.t0 == t
                t += e.n
                ended = e.terminated or e.truncated
            elif isinstance(e, EpisodeAbort):
                ended = True
        assert ended, eid
