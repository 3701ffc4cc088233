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
    stub = SimpleNamespace(_rlrec_holdout=0.25, rlrec_held_out=0)
    kept = [i for i in ids if not SafeOfflinePreLearner._held_out(stub, SimpleNamespace(id_=i))]
    assert set(kept) == {i for i in ids if not is_held_out(i, 0.25)}
    assert stub.rlrec_held_out == 200 - len(kept) > 20
    off = SimpleNamespace(_rlrec_holdout=0.0, rlrec_held_out=0)
    assert not any(SafeOfflinePreLearner._held_out(off, SimpleNamespace(id_=i)) for i in ids)
