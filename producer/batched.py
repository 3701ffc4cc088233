"""`EpisodeRecorder`'s batched calls: `begin_episodes` and `log_steps` record one row per
episode (e.g. a vector env's step) with one lock acquisition, exactly as one `begin_episode` /
`log_step` per row in row order would (the same copies, messages, keys and `stats`).

A call is checked as a whole before anything is recorded: rows are split and copied outside the
lock (`producer/rows.py`), then under the lock every episode is looked up and every first step's
outputs checked, overflow is decided for the whole batch, and only then are the rows appended
(and their batches emitted) in row order by the recorder's own machinery.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Mapping, Sequence
from functools import partial
from itertools import compress
from operator import itemgetter, or_
from typing import Any

import numpy as np
from confluent_kafka import KafkaException

from rlrec.producer import recorder as _r  # the recorder's state and helpers (imported first)
from rlrec.producer.avro_write import _SMALL, ARRAY_END, long_bytes, string_bytes
from rlrec.producer.events import dumps_info
from rlrec.producer.rows import (
    batch_len,
    checked_id,
    flags,
    new_episode_ids,
    new_episode_keys,
    row_slices,
    row_values,
    rows_of,
    select,
    selected_rows,
)

__all__ = ["BatchedCalls"]

_EXACT_FLOATS = (np.float32, np.float64)  # rewards whose tolist() equals that of their float64 copy
_ID_LEN, _ID_HEAD = {32}, long_bytes(32)  # the Avro length of 32-byte episode ids (uuid4 hex)


class BatchedCalls:
    """The batched calls of `EpisodeRecorder` (its base class; see the module docstring)."""

    #: begin_episodes' shared EpisodeStart parts: (timestamp bytes, policy version, observation
    #: bytes per row, what precedes a row's observation bytes, what follows them)
    _start_frame: tuple = (None, None, None, b"", b"")

    def begin_episodes(
        self,
        observations: Any,
        infos: Sequence[Mapping | None] | None = None,
        episode_ids: Sequence[str | None] | None = None,
        policy_versions: Sequence[int | None] | None = None,
    ) -> list[str]:
        """Start one episode per row of a batch (e.g. a vector env's reset); returns their ids.

        The same as `begin_episode` called for each row in row order (the same messages, keys
        and `stats`), checked as a whole first: when any row is refused (an invalid value, an
        id already open or given twice) nothing is recorded. When the buffer has no room for
        every row, `on_overflow` applies to the whole batch ("raise": nothing recorded; "drop":
        every episode of the batch is dropped; "block": waits for room for all of them, or for
        an empty buffer). One lock acquisition per call.

        Args:
            observations: the reset observations batched on axis 0 (gymnasium's batching: an
                array, or a dict/tuple of batched arrays for Dict/Tuple spaces).
            infos: one reset info (or None) per row; None: no infos.
            episode_ids: one id (or None for a new uuid4 hex) per row; None: all new.
            policy_versions: one version (or None for the recorder's) per row; None: the
                recorder's for all (a canary may choose versions per episode).

        Returns:
            The episode ids, in row order.

        Raises:
            As `begin_episode`.

        Example:
            >>> ids = rec.begin_episodes(np.zeros((3, 4), np.float32))  # doctest: +SKIP
            >>> len(ids)  # doctest: +SKIP
            3
        """
        if self._unusable:
            self._check_usable()
        if self._multi_agent_only:
            raise TypeError(_r._MULTI_AGENT_ONLY)
        packer = self._obs
        if (
            infos is None
            and episode_ids is None
            and policy_versions is None
            and type(observations) is np.ndarray
            and observations.dtype is packer.dtype
            and observations.shape[1:] == packer.shape
            and packer.shape  # not a scalar leaf: each row's kept value is its bytes
            and not self.validate_spaces
            and observations.size  # some rows, each of some bytes
        ):
            return self._begin_plain(observations)
        n = len(observations) if type(observations) is np.ndarray else batch_len(observations)
        given = infos is not None or episode_ids is not None or policy_versions is not None
        infos = [None] * n if infos is None else select(infos, None)
        ids = [None] * n if episode_ids is None else select(episode_ids, None)
        versions = [None] * n if policy_versions is None else select(policy_versions, None)
        if given:
            for what, col in (("infos", infos), ("episode_ids", ids), ("policy_versions", versions)):
                if len(col) != n:
                    raise ValueError(f"{what} has {len(col)} rows, observations has {n}")
        if self.validate_spaces:
            for row in rows_of(self.observation_space, observations, n, "observations"):
                if bad := _r.space_problem(self.observation_space, row):
                    raise ValueError(f"observation {row!r:.200} {bad}")
        kept = row_values(self._obs, self.observation_space, observations, n, None, "observations")
        out = new_episode_ids(n) if episode_ids is None else [checked_id(e) for e in ids]
        if episode_ids is not None and None in ids:
            fresh = iter(new_episode_ids(ids.count(None)))
            out = [next(fresh) if e is None else x for e, x in zip(ids, out)]
        # the EpisodeStart records (see `_start_value`), what the rows share encoded once
        pid_env, spaces = self._start_avro
        ts = _r._now_ms_bytes()
        keys = [eid.encode() for eid in out]  # the Kafka keys; with their lengths, the Avro ids
        if set(map(len, keys)) == _ID_LEN:  # e.g. new ids (uuid4 hex)
            avros = [_ID_HEAD + kb for kb in keys]
        else:
            avros = [long_bytes(len(kb)) + kb for kb in keys]
        one_leaf = packer.single and n and set(map(type, kept)) == {bytes}  # one leaf, each row its wire bytes
        if one_leaf and (not given or (versions.count(None) == n and infos.count(None) == n)):
            head, tail = self._start_parts(ts, len(kept[0]))
            values = [b"".join((avro, head, data, tail)) for avro, data in zip(avros, kept)]
        else:
            no_info = string_bytes("") + spaces + ts
            default = long_bytes(self._policy_version)
            vbytes = [default if v is None else long_bytes(self._check_version(v)) for v in versions]
            if one_leaf:
                head = packer._count + packer._one_heads[0] + long_bytes(len(kept[0]))
                middle = [(head, data, ARRAY_END) for data in kept]
            else:
                middle = []
                for k in kept:
                    obs_parts: list = []
                    packer.write_kept(obs_parts, k)
                    middle.append(obs_parts)
            values = [
                b"".join(
                    (
                        avro,
                        pid_env[0],
                        ver,
                        pid_env[1],
                        *mid,
                        no_info if not info else string_bytes(dumps_info(info)) + spaces + ts,
                    )
                )
                for avro, ver, mid, info in zip(avros, vbytes, middle, infos)
            ]
        if episode_ids is not None and len(set(out)) != n:  # new ids are random uuid4s, as begin_episode's
            raise ValueError("episode_ids names an episode twice")
        limit = self._max_start
        for kb, value in zip(keys, values):
            if len(kb) + len(value) > limit:
                self._check_start_size(kb, value)  # raises: a refused row records no row
        return self._admit_starts(out, keys, avros, values)

    def _start_parts(self, ts: bytes, size: int) -> tuple[bytes, bytes]:
        """What every EpisodeStart of a `size`-byte single-leaf observation, no info and the
        recorder's policy version has before and after its id and observation bytes (remembered
        for the calls of one millisecond, version and size)."""
        frame = self._start_frame
        version = self._policy_version
        if frame[0] is not ts or frame[1] != version or frame[2] != size:
            (pid, env), spaces = self._start_avro
            obs = self._obs
            head = pid + long_bytes(version) + env + obs._count + obs._one_heads[0] + long_bytes(size)
            frame = self._start_frame = (ts, version, size, head, ARRAY_END + string_bytes("") + spaces + ts)
        return frame[3], frame[4]

    def _begin_plain(self, observations: np.ndarray) -> list[str]:
        """`begin_episodes` of the common batch: new ids, the recorder's version, no infos, an
        array of exactly the single-leaf observation space's dtype and row shape (unvalidated).
        Every row's EpisodeStart shares all but its id and observation bytes, so the values are
        the slices of one copy of the batch joined between two shared parts."""
        n = len(observations)
        data = observations.tobytes()  # C order: row j is data[j * k:(j + 1) * k]
        k = len(data) // n
        out, keys = new_episode_keys(n)
        avros = [_ID_HEAD + kb for kb in keys]
        head, tail = self._start_parts(_r._now_ms_bytes(), k)
        values = [b"".join((avro, head, data[s], tail)) for avro, s in zip(avros, row_slices(n, k))]
        self._check_start_size(keys[0], values[0])  # every row the same size
        return self._admit_starts(out, keys, avros, values)

    def _admit_starts(self, out: list, keys: list, avros: list, values: list) -> list[str]:
        """Send a checked batch's EpisodeStarts under one lock acquisition, or drop them as the
        recorder's overflow policy says (`on_overflow="block"`: wait for room without the lock,
        then look again); an id already open refuses the whole batch."""
        n = len(out)
        while True:
            with self._lock:
                if self._busy:
                    raise self._reentry("begin_episodes")
                self._busy = True
                try:
                    if self._closing:
                        raise _r.RecorderClosed("the recorder is closed")
                    episodes = self._episodes
                    for eid in out:
                        if eid in episodes:
                            raise ValueError(f"episode {eid} is already open")
                    buffered = self._buffered
                    if buffered + n <= self._max_buffered_steps or not buffered:
                        self._send_starts(out, keys, avros, values)
                        return out
                    if not self._overflow(None, False):
                        self._drop_starts(out)
                        return out
                finally:
                    self._busy = False
            time.sleep(_r._WAIT_S)

    def _drop_starts(self, ids: list) -> None:
        """Register the episodes of a batch `on_overflow="drop"` dropped (`_overflow` counted one)."""
        episodes = self._episodes
        for eid in ids:
            ep = _r._Episode(eid)
            ep.dropping = True  # nothing of it is sent
            self._episodes_begun += 1
            episodes[eid] = ep
        self._dropped += len(ids) - 1

    def _send_starts(self, ids: list, keys: list, avros: list, values: list) -> None:
        """Send the EpisodeStart messages and register the episodes, in row order: what `_send`
        and `begin_episode` do per row, counted once for the batch. A row librdkafka does not
        take at once (its queue full, an error) goes, with the rows after it, the single way."""
        n = len(ids)
        prefix, headers = self._wire["EpisodeStart"]
        produce, topic, delivered = self._producer.produce, self.topic, self._on_delivery
        # counted first, as `_send` counts each message before handing it over
        self._buffered += n
        self._msgs[0] += n
        Episode = _r._Episode
        eps = list(map(Episode, ids, avros))  # registered once their EpisodeStarts are handed over
        wire = [prefix + v for v in values] if prefix else values
        j = 0
        try:
            for eid, kb, value in zip(ids, keys, wire):
                produce(topic, value, kb, headers=headers, on_delivery=partial(delivered, eid, 1))
                j += 1
        except (BufferError, KafkaException):
            self._buffered -= n - j
            self._msgs[0] -= n - j
            self._episodes_begun += j
            self._episodes.update(zip(ids[:j], eps))
            for eid, value, avro in zip(ids[j:], values[j:], avros[j:]):
                self._send(eid, value, "EpisodeStart", 1, 1)  # before registering: it may raise
                self._episodes_begun += 1
                self._episodes[eid] = Episode(eid, avro)
            return
        self._episodes_begun += n
        self._episodes.update(zip(ids, eps))

    def log_steps(
        self,
        episode_ids: Sequence[str | None],
        actions: Any,
        rewards: Any,
        observations: Any,
        terminated: Any,
        truncated: Any,
        infos: Sequence[Mapping | None] | None = None,
        extra_model_outputs: Mapping[str, Any] | None = None,
        rows: Any = None,
    ) -> None:
        """Record one step of each of several episodes (e.g. one vector env step).

        The same as `log_step` called for each selected row in row order (the same copies,
        messages, keys and `stats`), checked as a whole first: when any row is refused (an
        episode not open or named twice, an invalid value) nothing is recorded. When the buffer
        has no room for every row, `on_overflow` applies to the whole batch ("raise": nothing
        recorded; "drop": every row is dropped, and its episode's rest; "block": waits for room
        for all of them, or for an empty buffer). One lock acquisition per call.

        Args:
            episode_ids: one open episode id per row (rows left out by `rows` may hold None).
            actions: the actions taken, batched on axis 0 (as gymnasium batches them).
            rewards: one reward per row (an array or a sequence of finite numbers).
            observations: the observations after the step, batched on axis 0.
            terminated: one flag per row (an array or a sequence).
            truncated: one flag per row.
            infos: one info (or None) per row; None: no infos.
            extra_model_outputs: key -> values batched on axis 0 (row i with ``actions[i]``),
                as `log_step` takes them per row (``action_logp`` checked for every row).
            rows: a boolean mask of the rows to record (e.g. the real transitions of a
                NEXT_STEP vector step, leaving its reset rows out); None: every row.

        Raises:
            As `log_step`. An episode whose batch could not be encoded or sent is aborted and
            the first such ValueError is raised after every row was recorded.

        Example:
            >>> rec.log_steps(ids, np.array([0, 1]), np.ones(2), obs, np.zeros(2, bool), np.zeros(2, bool))  # doctest: +SKIP
        """
        if self._unusable:
            self._check_usable()
        n = len(episode_ids)
        mask = selected_rows(rows, n)  # arrays take their rows with it, lists with `idx`
        idx = None if mask is None else mask.tolist()
        ids = select(episode_ids, idx)
        m = len(ids)
        if not m:
            return
        if type(rewards) is np.ndarray and rewards.shape == (n,) and rewards.dtype.kind == "f":
            # float32 and float64 become the same Python floats as through float64
            if rewards.dtype.type not in _EXACT_FLOATS:
                rewards = rewards.astype(np.float64)
            rew = (rewards if mask is None else rewards[mask]).tolist()
        else:
            if len(rewards) != n:
                raise ValueError(f"rewards has {len(rewards)} rows, episode_ids has {n}")
            rew = []
            for r in select(rewards, idx):
                rew.append(r if type(r) is float else _r._reward_float(r))
        if (s := sum(rew)) - s != 0.0:  # some reward is NaN or +-inf (or the sum overflowed)
            for r, eid in zip(rew, ids):
                if r - r != 0.0:
                    raise ValueError(f"reward must be finite, got {r} (episode {eid})")
        if self.validate_spaces:
            act_rows = select(rows_of(self.action_space, actions, n, "actions"), idx)
            obs_rows = select(rows_of(self.observation_space, observations, n, "observations"), idx)
            for a, o in zip(act_rows, obs_rows):
                self._validate(a, o)
        obs = row_values(self._obs, self.observation_space, observations, n, mask, "observations")
        act = row_values(self._act, self.action_space, actions, n, mask, "actions")
        term = flags(terminated, n, mask, "terminated")
        trunc = flags(truncated, n, mask, "truncated")
        if infos is None:
            info_json = [""] * m
        else:
            if len(infos) != n:
                raise ValueError(f"infos has {len(infos)} rows, episode_ids has {n}")
            info_json = [dumps_info(x) if x else "" for x in select(infos, idx)]
        extras = [None] * m if not extra_model_outputs else self._batch_outputs(extra_model_outputs, n, idx, ids)
        self._log_rows(ids, act, rew, obs, info_json, extras, term, trunc)

    @staticmethod
    def _batch_outputs(extra: Mapping, n: int, idx: Any, ids: list) -> list:
        """What log_step keeps of each selected row's outputs ``{k: extra[k][i]}``."""
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra_model_outputs must map keys to batched values, got {type(extra).__name__}")
        lp = extra.get("action_logp") if len(extra) == 1 else None
        if type(lp) is np.ndarray and lp.shape == (n,) and lp.dtype.type in _r._FLOAT_TYPES:
            # the common case, only the propensity: one scalar per row (see _r._Episode.steps)
            col = select(lp.tolist() if lp.dtype == np.float64 else list(lp), idx)
            fl = np.asarray(col, np.float64)
            if not (np.isfinite(fl).all() and (fl <= _r.LOGP_TOLERANCE).all()):
                for v, eid in zip(col, ids):
                    _r._check_logp(v, eid)
            return col
        cols = {}
        for k, v in extra.items():
            if len(v) != n:
                raise ValueError(f"extra_model_outputs[{k!r}] has {len(v)} rows, episode_ids has {n}")
            cols[k] = select(v, idx)
        keys = list(cols)
        return [_r._kept_outputs(dict(zip(keys, row)), eid) for row, eid in zip(zip(*cols.values()), ids)]

    def _log_rows(
        self, ids: list, act: list, rew: list, obs: list, infos: list, extras: list, term: list, trunc: list
    ) -> None:
        """log_steps' work under the lock: every row checked, then every row recorded."""
        m = len(ids)
        while True:
            with self._lock:
                if self._busy:
                    raise self._reentry("log_steps")
                self._busy = True
                try:
                    episodes = self._episodes
                    try:
                        eps = [episodes[ids[0]]] if m == 1 else itemgetter(*ids)(episodes)
                    except (KeyError, TypeError):
                        for e in ids:
                            if episodes.get(e) is None:
                                raise self._not_open(e) from None
                        raise
                    if len(set(ids)) != m:
                        raise ValueError("episode_ids names an episode twice; log its steps in separate calls")
                    if self._ma_open and any(type(e) is not _r._Episode for e in eps):  # before anything counts
                        raise next(e for e in eps if type(e) is not _r._Episode).wrong_call()
                    keys = {}
                    if extras[0] is not None or extras.count(None) != m:  # some outputs given
                        ts = list(map(_r._t_of, eps))
                        if 0 in ts:  # first steps: their outputs' keys are checked (and kept) first
                            keys = {
                                j: _r._extra_keys(extras[j]) for j, t in enumerate(ts) if not t and not eps[j].dropping
                            }
                    # only episodes of a recorder that dropped records may be dropping
                    live = m - sum(map(_r._dropping_of, eps)) if self._dropped else m
                    buffered = self._buffered
                    if buffered + live <= self._max_buffered_steps or not buffered or not live:
                        self._record_rows(eps, keys, live, act, rew, obs, infos, extras, term, trunc)
                        return
                    if not self._overflow(None, False):  # raises for "raise"; False for "drop"
                        self._dropped -= 1  # counted per row below
                        for j, ep in enumerate(eps):
                            done = term[j] or trunc[j]
                            if ep.dropping:
                                self._overflow(ep, done)
                            else:
                                self._count_drop()
                                self._abort_dropping(ep)
                                if done:
                                    self._end(ep)
                        return
                finally:
                    self._busy = False
            time.sleep(_r._WAIT_S)  # on_overflow="block": wait for room without the lock, then look again

    def _record_rows(
        self,
        eps: Sequence,
        keys: dict,
        live: int,
        act: list,
        rew: list,
        obs: list,
        infos: list,
        extras: list,
        term: list,
        trunc: list,
    ) -> None:
        """Append each row's step to its episode, in row order, emitting as `log_step` does."""
        for j, k in keys.items():
            eps[j].extra_keys = k
        # counted first: an exception from a signal handler that stops the loop leaves rows
        # counted but never sent, which close() counts as failed (never a negative count)
        self._buffered += live
        now = _r._monotonic()
        limit = self._batch_limit
        if self._step_bytes is not None and not self._dropped:  # the common case: see below
            full = []  # the episodes whose buffer reached the batch limit
            for ep, step in zip(eps, zip(act, rew, obs, infos, extras)):
                steps = ep.steps
                if not steps:
                    ep.first_buffered = now
                steps += step
                t = ep.t = ep.t + 1
                if t - ep.t0 >= limit:
                    full.append(ep)
            if full:
                due = [(ep, te, tr) for ep, te, tr in zip(eps, term, trunc) if te or tr or ep in full]
            elif True in term or True in trunc:
                # the done rows (rarely both kinds in one call: then each flag alone marks them)
                ended = term if True not in trunc else trunc if True not in term else map(or_, term, trunc)
                due = [(eps[j], term[j], trunc[j]) for j in compress(range(len(eps)), ended)]
            else:
                return
            self._emit_rows(due)
            return
        if self._step_bytes is not None:  # the batch limit is settled: batches are sent after the loop
            due = []
            for ep, step, te, tr in zip(eps, zip(act, rew, obs, infos, extras), term, trunc):
                if ep.dropping:
                    self._overflow(ep, te or tr)
                    continue
                steps = ep.steps
                if not steps:
                    ep.first_buffered = now
                steps += step
                t = ep.t = ep.t + 1
                if te or tr or t - ep.t0 >= limit:
                    due.append((ep, te, tr))
            if due:
                self._emit_rows(due)
            return
        error = None
        for ep, step, te, tr in zip(eps, zip(act, rew, obs, infos, extras), term, trunc):
            if ep.dropping:
                self._overflow(ep, te or tr)
                continue
            steps = ep.steps
            if not steps:
                ep.first_buffered = now
            steps += step
            t = ep.t = ep.t + 1
            if te or tr or t - ep.t0 >= limit:
                try:
                    if te or tr:
                        self._emit(ep, te, tr)
                        self._end(ep)
                    else:
                        self._emit(ep, False, False)
                except ValueError as e:  # the episode was aborted; the other rows are recorded
                    error = error or e
                limit = self._batch_limit  # the first batch ever sent sets it
        if error is not None:
            raise error

    def _emit_rows(self, due: list) -> None:
        """`_emit` (and `_end` for a done row) of each (episode, terminated, truncated) in row
        order, as `log_step` does them one by one: the common batch (single-leaf spaces, no
        infos, outputs or delayed rewards) is encoded here with what the rows share looked up
        once, anything else by `_encode_batch`; a batch that cannot be encoded or handed over
        takes `_emit`'s own way (the episode aborted, the first such ValueError raised at the
        end, after every row)."""
        act, obs = self._act, self._obs
        fast = act.single and obs.single
        if fast:
            a_count, (a_head, a_tail), a_code = act._count, act._heads[0], act.int_code
            o_count, (o_head, o_tail), o_code = obs._count, obs._heads[0], obs.int_code
        ts = _r._now_ms_bytes()
        prefix, headers = self._wire["StepBatch"]
        produce, topic, delivered = self._producer.produce, self.topic, self._on_delivery
        episodes, finished = self._episodes, self._finished
        flag_bytes, msgs = _r._FLAGS, self._msgs
        fields, small = _r._STEP_FIELDS, _SMALL
        ended: list = []  # (id, length) of the episodes ended, remembered in `finished` at once
        error = None
        for ep, te, tr in due:
            steps = ep.steps
            n = len(steps) // fields
            t1 = ep.t
            value = None
            if fast and not ep.reward_adds and not ep.extra_keys:
                extras, infos = steps[4::fields], steps[3::fields]
                if extras.count(None) == n and not any(infos):
                    actions, observations = steps[0::fields], steps[2::fields]
                    try:
                        adata = (
                            array(a_code, actions).tobytes()
                            if a_code and type(actions[0]) is int
                            else b"".join(actions)
                        )
                        odata = (
                            array(o_code, observations).tobytes()
                            if o_code and type(observations[0]) is int
                            else b"".join(observations)
                        )
                    except TypeError:  # ints mixed with bytes: `_encode_batch` writes them
                        pass
                    else:
                        t0, na, no = ep.t0, len(adata), len(odata)
                        # the longs of the batch (small ones looked up: `long_bytes` costs a call)
                        nb = small[n] if n < 4096 else long_bytes(n)
                        value = b"".join(
                            (
                                ep.id_avro,
                                small[t0] if t0 < 4096 else long_bytes(t0),
                                a_count,
                                a_head,
                                nb,
                                a_tail,
                                small[na] if na < 4096 else long_bytes(na),
                                adata,
                                ARRAY_END,
                                _r._REWARDS_HEAD,
                                nb,
                                ARRAY_END,
                                small[8 * n] if n < 512 else long_bytes(8 * n),
                                array("d", steps[1::fields]),
                                o_count,
                                o_head,
                                nb,
                                o_tail,
                                small[no] if no < 4096 else long_bytes(no),
                                odata,
                                ARRAY_END,
                                flag_bytes[te, tr],
                                _r._UNION_0,
                                ARRAY_END,
                                ts,
                            )
                        )
            if value is None:
                try:
                    value = self._encode_batch(ep, te, tr)
                except (ValueError, TypeError):
                    value = None
            if value is None:  # `_emit` encodes it again, fails the same way and aborts the episode
                if ended:  # in order: an abort remembers its episode as finished too
                    finished.set_many(ended)
                    ended = []
                try:
                    self._emit(ep, te, tr)
                except ValueError as e:
                    error = error or e
                continue
            # as `_emit`: taken off the episode before it is handed over
            ep.steps, ep.reward_adds = [], {}
            ep.t0 = t1
            eid = ep.id
            msgs[0] += 1
            try:
                produce(
                    topic,
                    prefix + value if prefix else value,
                    eid.encode(),
                    headers=headers,
                    on_delivery=partial(delivered, eid, n),
                )
            except (BufferError, KafkaException):  # `_send` waits out a full queue, or counts and raises
                msgs[0] -= 1
                if ended:
                    finished.set_many(ended)
                    ended = []
                try:
                    self._send(eid, value, "StepBatch", n, 0)
                except ValueError as e:  # as `_emit`: counted failed by `_send`, the episode aborted
                    try:
                        self._abort(ep, "produce-error")
                    except ValueError as abort_error:
                        error = error or abort_error
                        continue
                    if error is None:
                        error = ValueError(
                            f"episode {eid}: steps {t1 - n}..{t1 - 1} could not be sent and the episode was aborted: {e}"
                        )
                        error.__cause__ = e
                    continue
            if te or tr:
                episodes.pop(eid, None)
                ended.append((eid, t1))
        if ended:
            finished.set_many(ended)
        if error is not None:
            raise error
