"""A resumable torch `IterableDataset` over a snapshot's steps (imports torch: load it lazily,
through `rlrec.store.snapshot_reader.Snapshot.to_torch`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from rlrec.store.at_exit import close_at_exit
from rlrec.store.snapshot_reader import Snapshot
from rlrec.store.steps_table import STEP_COLUMNS, column_to_numpy

__all__ = ["StepsDataset"]


def _row(cols: dict[str, Any], i: int) -> dict[str, Any]:
    out = {}
    for k, v in cols.items():
        if isinstance(v, dict):
            out[k] = _row(v, i)
        elif isinstance(v, list):
            out[k] = v[i]
        else:
            out[k] = torch.as_tensor(np.array(v[i]))  # a copy: the column's buffers are read-only
    return out


class StepsDataset(IterableDataset):
    """The steps of a snapshot, one dict per step (`STEP_COLUMNS`; numbers as tensors, ids as
    str, Dict/Tuple observations as dicts), in the snapshot's order: shard by shard, rows in
    order. Resumable: `state_dict` says how many steps were handed out, `load_state_dict` (on a
    dataset of a snapshot opened at the same cursor, with the same `Snapshot.selection`) continues after them, with no step repeated
    or skipped.

    The state is the iteration of this process (``DataLoader(num_workers=0)``); with workers,
    each worker reads every n-th shard and the state is not tracked.

    Args:
        snapshot: the snapshot to read.
        columns: the step columns to hand out (default: all).

    Example::

        >>> import rlrec  # doctest: +SKIP
        >>> ds = rlrec.open("/data/shards").to_torch()  # doctest: +SKIP
        >>> it = iter(ds); first = [next(it) for _ in range(10)]; state = ds.state_dict()  # doctest: +SKIP
        >>> ds2 = rlrec.open("/data/shards", as_of=state["cursor"]).to_torch()  # doctest: +SKIP
        >>> ds2.load_state_dict(state)  # doctest: +SKIP
    """

    def __init__(self, snapshot: Snapshot, *, columns: tuple[str, ...] | None = None) -> None:
        super().__init__()
        unknown = set(columns or ()) - set(STEP_COLUMNS)
        if unknown:
            raise ValueError(f"unknown step column(s) {sorted(unknown)}; choose from {list(STEP_COLUMNS)}")
        self.snapshot = snapshot
        self.columns = tuple(columns) if columns else STEP_COLUMNS
        self._position = 0

    def __len__(self) -> int:
        return self.snapshot.num_steps

    def state_dict(self) -> dict[str, Any]:
        """``{"cursor": the snapshot's cursor, "selection": its selection (None: the whole
        point; `Snapshot.subset`), "position": steps handed out}``."""
        return {"cursor": self.snapshot.cursor, "selection": self.snapshot.selection, "position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the steps `state` (from `state_dict`) counts; ValueError if it is of
        another snapshot (another cursor, or another selection of it) or past its end."""
        if state.get("cursor") != self.snapshot.cursor:
            raise ValueError(
                f"the state is of the snapshot at {state.get('cursor')!r}, this dataset reads {self.snapshot.cursor!r}"
            )
        if state.get("selection") != self.snapshot.selection:

            def name(sel: Any) -> str:
                return "the whole point" if sel is None else f"selection {sel!r:.40}"

            raise ValueError(
                f"the state is of {name(state.get('selection'))} at that cursor, this dataset reads "
                f"{name(self.snapshot.selection)} (e.g. a policy version's data, not the whole point)"
            )
        pos = state.get("position")
        if not isinstance(pos, int) or isinstance(pos, bool) or pos < 0:
            raise ValueError(f"bad position {pos!r}")
        if not self.snapshot.filtered and pos > self.snapshot.num_steps:  # the manifest counts them
            raise ValueError(f"bad position {pos!r} (0..{self.snapshot.num_steps})")
        self._position = pos  # (a filtered snapshot's steps are counted by reading: checked while iterating)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return close_at_exit(self._rows())  # one left open releases its tables at exit (rlrec.store.at_exit)

    def _rows(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        workers, me = (1, 0) if info is None else (info.num_workers, info.id)
        skip = self._position if workers == 1 else 0
        for i, entry in enumerate(self.snapshot.entries):
            if i % workers != me:
                continue
            table = None
            if not self.snapshot.filtered:
                n = entry.steps  # skipped without reading
            else:  # counted by reading: the table read once serves both
                table = self.snapshot.shard_steps(entry)
                n = table.num_rows
            if skip >= n:
                skip -= n
                continue
            if table is None:
                table = self.snapshot.shard_steps(entry)
            table = table.select(list(self.columns)).slice(skip)
            skip = 0
            cols = {name: column_to_numpy(table.column(name).combine_chunks()) for name in self.columns}
            for r in range(table.num_rows):
                if workers == 1:
                    self._position += 1
                yield _row(cols, r)
        if skip:
            raise ValueError(f"bad position {self._position} (the snapshot holds {self._position - skip} steps)")
