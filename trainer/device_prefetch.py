"""Host -> device copies that overlap the Learner's compute (one minibatch ahead)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

__all__ = ["DevicePrefetcher", "writable"]


def writable(a: np.ndarray) -> np.ndarray:
    """A contiguous array torch may share: arrays viewed from Arrow buffers are read-only, and
    torch warns about (and must not write through) a tensor over read-only memory."""
    a = np.ascontiguousarray(a)
    return a if a.flags.writeable else a.copy()


class DevicePrefetcher:
    """Turns ``(numpy batch, tag)`` pairs into ``(torch batch on device, tag)`` pairs, in order.

    On a CUDA device (and only when CUDA is available) batch k+1 is staged in pinned host
    memory and copied with ``non_blocking=True`` on a side stream as soon as batch k is handed
    out, so the copy overlaps the Learner's compute on batch k; before batch k+1 is handed out
    the current stream waits for its copy (an event, not a device sync) and the tensors are
    marked as used on the current stream (``record_stream``), so the caching allocator does not
    reuse their memory early. Elsewhere (CPU) batches are converted one at a time by default
    (``ahead=True`` runs the same look-ahead, without streams), never pinned: CPU builds of torch
    raise on ``pin_memory()``.

    Guarantees: every input pair comes out exactly once, in input order, with the same tag and
    the same values; at most one batch is held ahead of the caller.
    """

    def __init__(self, device: Any = "cpu", ahead: bool | None = None) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        #: stage one batch ahead (default: on CUDA only; tests turn it on for CPU)
        self.ahead = self.cuda if ahead is None else bool(ahead)

    @property
    def pins_memory(self) -> bool:
        return self.cuda

    def _to_device(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, Any], Any]:
        torch = self.torch
        if not self.cuda:
            return {k: torch.as_tensor(writable(v), device=self.device) for k, v in batch.items()}, None
        with torch.cuda.stream(self.stream):
            out = {
                k: torch.as_tensor(writable(v)).pin_memory().to(self.device, non_blocking=True)
                for k, v in batch.items()
            }
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def _hand_out(self, staged: tuple[dict[str, Any], Any]) -> dict[str, Any]:
        out, done = staged
        if done is not None:
            current = self.torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in out.values():
                t.record_stream(current)
        return out

    def iterate(self, pairs: Iterable[tuple[dict[str, np.ndarray], Any]]) -> Iterator[tuple[dict[str, Any], Any]]:
        if not self.ahead:  # nothing to overlap with: convert on demand
            for batch, tag in pairs:
                yield self._to_device(batch)[0], tag
            return
        it = iter(pairs)
        try:
            batch, tag = next(it)
        except StopIteration:
            return
        staged = (self._to_device(batch), tag)
        for batch, tag in it:
            nxt = (self._to_device(batch), tag)  # copy k+1 starts before k is handed out
            yield self._hand_out(staged[0]), staged[1]
            staged = nxt
        yield self._hand_out(staged[0]), staged[1]
