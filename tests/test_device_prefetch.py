"""The host -> device prefetch of the Learner side.

On CPU (CI): the look-ahead path of `DevicePrefetcher` (order, tags, values, one batch ahead) and
`StreamIterator.iter_torch_batches` acknowledging a minibatch when the Learner gets it, never
when it is prefetched; the prefetcher never pins memory without CUDA (CPU builds of torch raise
on ``pin_memory()``), which these tests prove by running. Where CUDA is (bench/gpu_trainer.py's
machine), the last test runs the pinned copy, the side stream and the event wait.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlrec.trainer.device_prefetch import DevicePrefetcher
from rlrec.trainer.envelopes import ENVELOPE, pack_columns
from rlrec.trainer.feed import TAG
from rlrec.trainer.stream_iterator import StreamIterator


def test_prefetch_keeps_order_tags_and_values_and_holds_one_batch_ahead():
    torch = pytest.importorskip("torch")
    pulled = []

    def pairs():
        for i in range(5):
            pulled.append(i)
            yield {"obs": np.full((4, 3), i, np.float32), "a": np.arange(4) + i}, f"tag{i}"

    p = DevicePrefetcher("cpu", ahead=True)
    assert not p.pins_memory and not p.cuda
    got = []
    for tensors, tag in p.iterate(pairs()):
        got.append(tag)
        i = int(tag[3:])
        assert len(pulled) <= i + 2  # at most one batch staged ahead of the caller
        assert tensors["obs"].device.type == "cpu" and torch.equal(tensors["obs"], torch.full((4, 3), float(i)))
        assert tensors["a"].tolist() == [i, i + 1, i + 2, i + 3]
    assert got == [f"tag{i}" for i in range(5)]
    assert list(DevicePrefetcher("cpu").iterate([])) == []
    assert DevicePrefetcher("cpu").ahead is False  # on CPU nothing to overlap: on demand by default


class _Envelopes:
    """A stand-in for the Ray Data iterator: yields PreLearner envelopes (real packing)."""

    def __init__(self, chunks: int, rows: int) -> None:
        self.chunks, self.rows = chunks, rows

    def iter_batches(self, **_kw):
        for c in range(self.chunks):
            batch = {"obs": np.full((self.rows, 2), c, np.float32), TAG: np.full(self.rows, c + 1, np.int64)}
            yield {ENVELOPE: np.array([pack_columns(batch)], dtype=object)}


@pytest.mark.parametrize("ahead", [False, True])
def test_minibatches_are_acknowledged_when_the_learner_gets_them(ahead):
    pytest.importorskip("torch")
    it = StreamIterator(_Envelopes(chunks=8, rows=16), {"device_prefetch": ahead, "fresh_share": 1.0})
    acks = []
    ack = it._ack
    it._ack = lambda counts, wait, consumed: (acks.append(dict(counts)), ack(counts, wait, consumed))
    gen = it.iter_torch_batches(batch_size=16, device="cpu")
    try:
        for n in range(1, 4):
            b = next(gen)
            assert TAG not in b and b["obs"].shape == (16, 2)
            assert len(acks) == n  # the batch in the Learner's hands, not the staged one
            assert acks[-1] == {n: 16}  # its own rows' tags (chunk n), in order
            # one more minibatch was produced (taken from the stream) when prefetching
            assert it.stats["rows_streamed"] == 16 * (n + (1 if ahead else 0))
    finally:
        gen.close()
        it.close()


def test_rows_an_iteration_leaves_pulled_are_the_next_ones_first_and_every_chunk_is_acknowledged():
    """A Learner stops iterating after its minibatches for the iteration (a new generator each
    time): rows already pulled from the stream but not trained yet are kept for the next
    iteration, so every chunk's rows reach a gradient step and are acknowledged (a one-episode
    shard is one small chunk: losing it loses the shard's 'trained' for good)."""
    it = StreamIterator(_Envelopes(chunks=12, rows=5), {"fresh_share": 0.25})
    acked: set[int] = set()
    ack = it._ack
    it._ack = lambda counts, wait, consumed: (acked.update(counts), ack(counts, wait, consumed))
    try:
        for _ in range(40):  # iterations of 2 minibatches of 8 rows, 2 of them fresh once warm
            gen = it.iter_batches(batch_size=8)
            got = [b for _, b in zip(range(2), gen)]
            gen.close()
            if len(got) < 2:  # the stream ended and nothing is left
                break
        assert it.stats["rows_streamed"] == 12 * 5  # every streamed row trained once as fresh
        assert acked == set(range(1, 13))
    finally:
        it.close()


def test_on_cuda_batches_arrive_pinned_copied_on_a_side_stream_in_order_with_their_values():
    """Runs only where CUDA is (bench/gpu_trainer.py runs it on a GPU machine): the pinned,
    non-blocking copy on the side stream, the event the current stream waits on, and values
    that a kernel on the current stream reads right after the hand-out (a missing wait would
    read a half-copied buffer now and then: 200 batches, each checked on the device)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    p = DevicePrefetcher("cuda")
    assert p.cuda and p.pins_memory and p.ahead and p.stream is not None
    rng = np.random.default_rng(0)
    sent = []

    def pairs():
        for i in range(200):
            obs = rng.standard_normal((2048, 64)).astype(np.float32)
            obs.flags.writeable = i % 2 == 0  # read-only arrays (viewed from Arrow) are copied first
            sent.append(obs)
            yield {"obs": obs, "a": np.full(2048, i, np.int64)}, i

    seen = []
    for tensors, tag in p.iterate(pairs()):
        assert tensors["obs"].is_cuda and tensors["a"].is_cuda
        assert len(sent) <= tag + 2  # one batch staged ahead
        # compare on the current stream: it must see the whole copy
        want = torch.from_numpy(sent[tag].copy()).to("cuda")
        assert bool(torch.equal(tensors["obs"], want)) and bool((tensors["a"] == tag).all())
        seen.append(tag)
    assert seen == list(range(200))
