"""The one retry schedule (`rlrec.store.retry`): exponential backoff with jitter."""

from __future__ import annotations

import pytest

from rlrec.store.retry import BACKGROUND, RetryPolicy, RetrySchedule


def test_waits_double_up_to_the_cap_and_jitter_only_shortens_them():
    exact = RetryPolicy(attempts=None, base_delay=0.5, max_delay=30.0, jitter=0)
    assert [exact.delay(i) for i in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert exact.delay(10_000) == 30.0  # no overflow however long it fails
    for jitter in (0.5, 1.0):
        p = RetryPolicy(attempts=None, base_delay=0.5, max_delay=30.0, jitter=jitter)
        for i in range(10):
            waits = [p.delay(i) for _ in range(200)]
            assert all((1 - jitter) * exact.delay(i) <= w <= exact.delay(i) for w in waits)
            assert len(set(waits)) > 100  # spread, not one value


def test_a_bounded_policy_gives_up_after_its_attempts_and_an_unbounded_one_never():
    p = RetryPolicy(attempts=3)
    assert [p.gives_up(n) for n in (0, 1, 2, 3, 4)] == [False, False, False, True, True]
    assert not BACKGROUND.gives_up(10**9)


@pytest.mark.parametrize(
    "kw", [{"attempts": 0}, {"base_delay": -1.0}, {"max_delay": -1.0}, {"jitter": 1.5}, {"jitter": -0.1}]
)
def test_nonsense_policies_are_refused(kw):
    with pytest.raises(ValueError):
        RetryPolicy(**kw)


def test_a_schedule_counts_failures_since_the_first_and_starts_over_after_a_success():
    s = RetrySchedule(RetryPolicy(attempts=None, base_delay=1.0, max_delay=4.0, jitter=0))
    assert s.due(0.0)
    assert [s.failed(now) for now in (100.0, 101.0, 103.0, 107.0)] == [1.0, 2.0, 4.0, 4.0]
    assert (s.failures, s.since, s.next_at) == (4, 100.0, 111.0)
    assert not s.due(110.9) and s.due(111.0)
    s.succeeded()
    assert (s.failures, s.since) == (0, None) and s.due(0.0)
    assert s.failed(200.0) == 1.0  # from the first wait again


def test_storage_refuses_a_policy_that_would_retry_in_place_for_ever(tmp_path):
    from rlrec.store.storage import Storage

    with pytest.raises(ValueError, match="bounded"):
        Storage.from_uri(str(tmp_path), retry=RetryPolicy(attempts=None))
