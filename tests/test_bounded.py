"""rlrec.producer.bounded: the byte-bounded LRU cache and the dict that forgets its older half."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlrec.producer.bounded import ByteBoundedLRU, OldestHalfDict


def test_lru_evicts_least_recently_used_first_within_the_byte_bound():
    c: ByteBoundedLRU[str, int] = ByteBoundedLRU(10)
    assert c.put("a", 1, 4) and c.put("b", 2, 4)
    assert c.get("a") == 1  # "b" is now the least recently used
    assert c.put("c", 3, 4)
    assert "b" not in c and list(c) == ["a", "c"] and c.nbytes == 8


def test_lru_peek_is_not_a_use():
    c: ByteBoundedLRU[str, int] = ByteBoundedLRU(8)
    c.put("a", 1, 4)
    c.put("b", 2, 4)
    assert c.peek("a") == 1
    c.put("c", 3, 4)
    assert list(c) == ["b", "c"]


def test_lru_refuses_a_value_larger_than_the_bound_and_drops_the_key():
    c: ByteBoundedLRU[str, str] = ByteBoundedLRU(10)
    c.put("k", "small", 3)
    assert c.put("k", "huge", 11) is False
    assert "k" not in c and c.nbytes == 0 and c.get("k", "none") == "none"


def test_lru_put_replaces_and_recounts():
    c: ByteBoundedLRU[str, str] = ByteBoundedLRU(10)
    c.put("k", "v1", 6)
    c.put("k", "v2", 2)
    assert c.get("k") == "v2" and c.nbytes == 2 and len(c) == 1
    assert c.pop("k") == "v2" and c.nbytes == 0 and c.pop("k", "gone") == "gone"


def test_lru_zero_bytes_entries_and_bad_sizes():
    c: ByteBoundedLRU[int, int] = ByteBoundedLRU(0)
    assert c.put(1, 1, 0) and c.get(1) == 1
    with pytest.raises(ValueError):
        c.put(2, 2, -1)
    with pytest.raises(ValueError):
        ByteBoundedLRU(-1)


@given(st.lists(st.tuples(st.sampled_from(["get", "put", "pop"]), st.integers(0, 7), st.integers(0, 40))))
def test_lru_matches_a_model(ops):
    """Against a list kept in use order: same contents, same order, total within the bound."""
    c: ByteBoundedLRU[int, int] = ByteBoundedLRU(64)
    model: list[tuple[int, int]] = []  # (key, size), least recently used first
    for op, key, size in ops:
        found = [i for i, (k, _) in enumerate(model) if k == key]
        if op == "get":
            assert (c.get(key) is not None) == bool(found)
            if found:
                model.append(model.pop(found[0]))
        elif op == "pop":
            assert (c.pop(key) is not None) == bool(found)
            if found:
                model.pop(found[0])
        else:
            if found:
                model.pop(found[0])
            assert c.put(key, size, size) == (size <= 64)
            if size <= 64:
                model.append((key, size))
                while sum(s for _, s in model) > 64:
                    model.pop(0)
        assert list(c) == [k for k, _ in model]
        assert c.nbytes == sum(s for _, s in model) <= 64


def test_oldest_half_dict_forgets_the_older_half_past_the_bound():
    d: OldestHalfDict[int, str] = OldestHalfDict(10)
    for i in range(10):
        d[i] = str(i)
    assert len(d) == 10
    d[10] = "10"  # the 11th key: the 5 oldest go
    assert list(d) == list(range(5, 11))
    d[5] = "again"  # an existing key keeps its place
    assert next(iter(d)) == 5 and d[5] == "again"


def test_oldest_half_dict_bounds_every_way_of_inserting():
    d: OldestHalfDict[int, int] = OldestHalfDict(4)
    d.update({i: i for i in range(5)})
    assert list(d) == [2, 3, 4]
    d.setdefault(9, 9)
    d |= {10: 10, 11: 11}
    assert len(d) <= 4 and 11 in d
    one: OldestHalfDict[str, int] = OldestHalfDict(1)
    one["a"] = 1
    one["b"] = 2
    assert dict(one) == {"b": 2}


def test_oldest_half_dict_is_a_dict_and_survives_copies():
    d: OldestHalfDict[str, int] = OldestHalfDict(3)
    d["a"] = 1
    assert isinstance(d, dict) and d.get("a") == 1 and d.pop("a") == 1 and "a" not in d
    d.update(x=1, y=2)
    for clone in (pickle.loads(pickle.dumps(d)), copy.deepcopy(d)):
        assert dict(clone) == {"x": 1, "y": 2} and clone.max_items == 3
    with pytest.raises(ValueError):
        OldestHalfDict(0)


def test_trainer_table_cache_is_lru_by_bytes_and_rechecks_stale_entries():
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("ray")
    from rlrec.trainer.read_task import _TableCache

    t = pa.table({"x": list(range(100))})
    c = _TableCache(max_bytes=2 * t.nbytes, ttl_s=0.0)  # every entry is stale: always rechecked
    c.put("a", t)
    assert c.get("a") is t and c.get("a", lambda: True) is t
    assert c.get("a", lambda: False) is None and c.get("a") is None  # the shard is gone: dropped
    for k in "abc":
        c.put(k, t)
    assert c.get("a") is None and c.get("b") is t and c.get("c") is t
