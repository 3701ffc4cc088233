"""The trainer side of the held-out split: the PreLearner drops held-out episodes, and the feed
counts a fresh shard whose chunks all came out empty as trained on (once) instead of delivering
it again. No Ray cluster."""

from __future__ import annotations

from types import SimpleNamespace

from rlrec.trainer.feed import FeedPolicy, FeedState
from rlrec.trainer.holdout import is_held_out
from tests.test_trainer_feed import Clock, shard


def test_feed_marks_an_all_held_out_shard_trained_once():
    clock = Clock()
    st = FeedState(FeedPolicy(chunk_rows=5, max_ahead_rows=10**9, fresh_fraction=1.0), clock=clock)
    st.add_shards([shard(1, rows=10), shard(2, rows=5)])
    works = [st.next_work() for _ in range(3)]
    assert [(w.shard.idx, w.start) for w in works] == [(1, 0), (1, 5), (2, 0)]
    st.processed([works[0].tag], 0)  # shard 1: first chunk empty, the second still pending
    assert 1 not in st.trained
    st.processed([works[1].tag], 0)
    st.processed([works[2].tag], 3)  # shard 2 produced rows: trained only when a Learner takes them
    assert 1 in st.trained and 2 not in st.trained
    stats = st.pop_stats()
    assert list(stats.newly_trained) == ["p/s1.parquet"]
    clock.t += 100  # past redeliver_after_s: shard 2 is fresh again, shard 1 never comes back
    assert {w.shard.idx for w in [st.next_work() for _ in range(3)] if w is not None and w.fresh} == {2}


def test_prelearner_drops_held_out_episodes():
    from rlrec.trainer.prelearner import SafeOfflinePreLearner

    ids = [f"ep-{i}" for i in range(200)]
    stub = SimpleNamespace(_rlrec_holdout=0.25, rlrec_held_out=0, _rlrec_multi_agent=False)
    kept = [i for i in ids if not SafeOfflinePreLearner._held_out(stub, SimpleNamespace(id_=i))]
    assert set(kept) == {i for i in ids if not is_held_out(i, 0.25)}
    assert stub.rlrec_held_out == 200 - len(kept) > 20
    off = SimpleNamespace(_rlrec_holdout=0.0, rlrec_held_out=0, _rlrec_multi_agent=False)
    assert not any(SafeOfflinePreLearner._held_out(off, SimpleNamespace(id_=i)) for i in ids)


def test_a_chunk_with_nothing_left_to_train_on_reports_no_rows_even_when_the_buffer_gives_some():
    """In "buffer" mode a PreLearner call returns rows sampled from earlier chunks' episodes even
    when this chunk's one episode was held out: the feed must hear 0 rows for this chunk (so its
    shard counts as trained on now), not the sampled rows (which carry other shards' tags: the
    shard would wait for an acknowledgement that never comes, and never count as trained)."""
    import numpy as np
    import pyarrow as pa

    from rlrec.trainer.envelopes import ENVELOPE, table_to_ipc
    from rlrec.trainer.feed import TAG
    from rlrec.trainer.prelearner import envelope_prelearner_class

    class Buffered:
        def __call__(self, batch):
            self.rlrec_last_skips = []
            self.rlrec_last_usable = 0 if batch["held"][0] else 1  # this chunk's episodes left
            return {"obs": np.zeros((8, 2), np.float32), TAG: np.full(8, 99, np.int64)}  # from the buffer

    calls = []
    feed = SimpleNamespace(
        processed=SimpleNamespace(remote=lambda tags, rows: calls.append((tags, rows))),
        skipped=SimpleNamespace(remote=lambda *a: None),
    )
    wrapped = object.__new__(envelope_prelearner_class(Buffered))
    wrapped._rlrec_feed = feed

    def envelope(tag: int, held: bool) -> dict:
        chunk = pa.table({"held": [held], TAG: [tag]})
        return {ENVELOPE: np.array([table_to_ipc(chunk)], dtype=object), TAG: np.array([tag])}

    wrapped(envelope(7, True))
    wrapped(envelope(8, False))
    assert calls == [([7], 0), ([8], 8)]


def test_an_all_held_out_shard_is_trained_once_when_its_results_come_late():
    """A PreLearner slower than the feed's patience (a minute, or redeliver_after_s): each chunk
    stops counting as in flight and the shard is delivered again before the result comes. The
    late empty results still count the shard as trained on, once, as soon as they cover its
    rows -- whatever delivery is still out -- and it is not delivered as fresh again."""
    clock = Clock()
    st = FeedState(FeedPolicy(chunk_rows=5, max_ahead_rows=10**9, fresh_fraction=1.0), clock=clock)
    st.add_shards([shard(1, rows=10)])
    first = [st.next_work() for _ in range(2)]  # rows 0-5 and 5-10
    clock.t += 120  # past both timeouts: given up on, and fresh again
    again = [st.next_work() for _ in range(2)]
    assert [(w.fresh, w.shard.idx, w.start) for w in again] == [(True, 1, 0), (True, 1, 5)]
    assert not any(w.tag in st.pending for w in first)
    st.processed([first[0].tag], 0)  # late: rows 0-5 only
    assert 1 not in st.trained
    st.processed([again[1].tag], 0)  # rows 5-10, from the redelivery; the other results still out
    assert 1 in st.trained and list(st.pop_stats().newly_trained) == ["p/s1.parquet"]
    st.processed([first[1].tag, again[0].tag], 0)  # the rest: counted once
    assert st.pop_stats().newly_trained == {}
    assert not st._fresh_ranges and not st._fresh_rows_out and not st._late  # nothing kept for it
    clock.t += 120
    assert not any(w is not None and w.fresh for w in [st.next_work() for _ in range(3)])


def test_a_shard_whose_late_results_produced_rows_waits_for_a_learner():
    """Late results with rows are not 'nothing to train on': such a shard is trained when a
    Learner acknowledges its rows, not when its chunks come out of the PreLearner."""
    clock = Clock()
    st = FeedState(FeedPolicy(chunk_rows=5, max_ahead_rows=10**9, fresh_fraction=1.0), clock=clock)
    st.add_shards([shard(1, rows=5)])
    w = st.next_work()
    clock.t += 120
    st.next_work()
    st.processed([w.tag], 4)
    assert 1 not in st.trained
    st.ack({w.tag: 4})
    assert 1 in st.trained


def test_late_results_of_a_shard_that_is_gone_are_forgotten():
    """A shard given up on in flight, then found missing: its late chunk is forgotten with it
    and its result, when it comes, counts for nothing."""
    clock = Clock()
    st = FeedState(FeedPolicy(chunk_rows=5, max_ahead_rows=10**9, fresh_fraction=1.0), clock=clock)
    st.add_shards([shard(1, rows=10)])
    first = st.next_work()
    clock.t += 120
    st.next_work()  # expires the first delivery into the late chunks
    assert first.tag in st._late
    st.mark_missing(1)
    assert not st._late and 1 not in st._fresh_ranges
    st.processed([first.tag], 0)
    assert 1 not in st.trained and not st._fresh_ranges and not st._fresh_rows_out
    clock.t += 4000  # and late chunks are forgotten after an hour in any case
    st.add_shards([shard(2, rows=5)])
    w = st.next_work()
    clock.t += 120
    st.next_work()
    assert w.tag in st._late
    clock.t += 3600
    st.next_work()
    assert w.tag not in st._late
