"""RLlib's `OfflinePreLearner` with a decoder that never unpickles, and envelope packing."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa
from ray.rllib.offline.offline_prelearner import OfflinePreLearner
from ray.rllib.utils import flatten_dict

from rlrec.trainer.envelopes import ENVELOPE, ipc_to_numpy_batch, pack_columns, row_count
from rlrec.trainer.feed import TAG
from rlrec.trainer.feed_actor import LEARNER_CONFIG_KEY, get_feed

log = logging.getLogger("rlrec.trainer")


def _tag_episode(ep: Any, tag: int) -> None:
    """Give every timestep of `ep` the extra model output TAG (rows keep it into the batch)."""
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

    rb = ep.rewards
    n = len(rb.data)
    data: Any = [tag] * n if isinstance(rb.data, list) else np.full(n, tag, dtype=np.int64)
    buf = InfiniteLookbackBuffer(data=data, lookback=rb.lookback)
    buf.finalized = rb.finalized
    ep.extra_model_outputs[TAG] = buf


class SafeOfflinePreLearner(OfflinePreLearner):
    """`OfflinePreLearner` that decodes episode rows with `rlrec.store.episodes.unpack_episode`.

    RLlib's own `__call__` runs ``msgpack.unpackb(item, object_hook=msgpack_numpy.decode)`` and
    ``SingleAgentEpisode.from_state``: both unpickle data from the shard (object arrays, space
    bounds), so anyone who can write to the bucket could run code in the trainer. This class
    refuses such payloads (the episode is skipped and counted), skips episodes the RLModule
    cannot use (`rlrec.trainer.episode_check.unusable_reason`: not done, empty, actions outside
    the action space, NaN/inf values, wrong shapes -- RLlib would raise and stop the pipeline or
    the Learner), keeps only the extra model
    outputs listed in ``learner_config_dict["rlrec"]["keep_extra_model_outputs"]`` (keys that
    differ between shards would break batching), drops the episodes held out for evaluation
    (``learner_config_dict["rlrec"]["holdout_fraction"]``, `rlrec.trainer.holdout.is_held_out`)
    and tags every timestep (``rlrec_tag``).
    Tabular rows are mapped by RLlib's `_map_to_episodes` (with ``input_compress_columns=[]``
    nothing is unpickled); the tag column rides along as an extra model output.

    Subclass it for custom pre-processing (``--offline-config prelearner_class=pkg.mod.Class``).
    """

    def __init__(self, *, config: Any, spaces: Any = None, module_state: Any = None, **kwargs: Any) -> None:
        super().__init__(config=config, spaces=spaces, module_state=module_state, **kwargs)
        spec = (config.learner_config_dict or {}).get(LEARNER_CONFIG_KEY, {})
        self._rlrec_keep = set(spec.get("keep_extra_model_outputs") or ())
        self._rlrec_mode = spec.get("prelearner_mode", "episodes")
        #: episodes held out for evaluation (rlrec.trainer.holdout) are never trained on
        self._rlrec_holdout = float(spec.get("holdout_fraction") or 0.0)
        #: multi-agent rows (`rlrec.trainer.multi_agent`): each agent episode checked against its own module
        self._rlrec_multi_agent = bool(spec.get("multi_agent"))
        self._rlrec_env_flags = self._rlrec_multi_agent and spec.get("multi_agent_flags") == "env"
        #: multi-agent: only rows of this multi-agent policy (``--policy-id``; None: any)
        self._rlrec_policy_id = spec.get("policy_id") if self._rlrec_multi_agent else None
        #: multi-agent "buffer" mode: one episode buffer per module, ids kept (`ModuleEpisodeBuffers`)
        self._rlrec_module_buffers = None
        if self._rlrec_multi_agent and self._rlrec_mode == "buffer":
            from rlrec.trainer.multi_agent_buffer import ModuleEpisodeBuffers

            self._rlrec_module_buffers = ModuleEpisodeBuffers(self._rlrec_new_buffer)
        self.rlrec_held_out = 0
        self.rlrec_skipped = 0
        #: (episode id, or "#<row in the chunk>" if undecodable; why) of each episode the last call
        #: skipped (read by the envelope wrapper, reported to the feed, which counts each once)
        self.rlrec_last_skips: list[tuple[str, str]] = []
        #: episodes of the last call's chunk left to train on (None: not known)
        self.rlrec_last_usable: int | None = None

    def _rlrec_new_buffer(self) -> Any:
        """An episode buffer like the one RLlib's PreLearner built (its class and arguments)."""
        kwargs = {
            "capacity": self.config.train_batch_size_per_learner * 10,
            "batch_size_B": self.config.train_batch_size_per_learner,
        } | self.config.prelearner_buffer_kwargs
        return type(self.episode_buffer)(**kwargs)

    def _rlrec_buffer(self) -> Any:
        """The buffer "buffer" mode samples: multi-agent rows' per-module ones, else RLlib's."""
        return self.episode_buffer if self._rlrec_module_buffers is None else self._rlrec_module_buffers

    def _skip(self, episode: str, reason: str) -> None:
        self.rlrec_skipped += 1
        self.rlrec_last_skips.append((episode, reason))
        if self.rlrec_skipped <= 10:  # the driver logs once per shard, after the iteration
            log.error("skipping an episode the trainer cannot use: %s", reason)

    def _rlrec_module_spaces(self, module_id: str | None = None) -> tuple[Any, Any]:
        """The spaces the RLModule is built for: the config's, else the module's. (The PreLearner's
        own `observation_space` can be the batched space of a vector env, e.g. Box(1, 3) for
        Pendulum with CQL, which no recorded episode fits.) With a `module_id` (an agent episode
        of multi-agent rows): that module's own, or (None, None) if no module has that id."""
        if module_id is not None:
            try:
                module = self._module[module_id]
            except (KeyError, TypeError):
                return None, None
            return module.observation_space, module.action_space
        obs, act = self.config.observation_space, self.config.action_space
        if obs is None or act is None:
            try:
                from ray.rllib.core import DEFAULT_MODULE_ID

                module = self._module[DEFAULT_MODULE_ID]
                obs, act = obs or module.observation_space, act or module.action_space
            except Exception:
                obs, act = obs or self.observation_space, act or self.action_space
        return obs, act

    def _held_out(self, ep: Any) -> bool:
        """Whether `ep` belongs to the held-out evaluation data (then it is not trained on),
        split by `rlrec.trainer.holdout.holdout_key`: an agent episode of multi-agent rows (a
        ``--multi-agent`` trainer reads only those) with its multi-agent episode, so no episode's
        agents are on both sides; any other episode by its own id."""
        if not self._rlrec_holdout:
            return False
        from rlrec.trainer.holdout import holdout_key, is_held_out

        ma_id = getattr(ep, "multi_agent_episode_id", None) if self._rlrec_multi_agent else None
        if is_held_out(holdout_key(getattr(ep, "id_", ""), ma_id), self._rlrec_holdout):
            self.rlrec_held_out += 1
            return True
        return False

    def _usable(self, ep: Any) -> bool:
        from rlrec.trainer.episode_check import unusable_reason

        module_id = getattr(ep, "module_id", None) if self._rlrec_multi_agent else None
        obs_space, act_space = self._rlrec_module_spaces(module_id)
        if obs_space is None and module_id is not None:
            reason = f"module {module_id!r:.40} is not one this trainer trains"
        else:
            reason = unusable_reason(ep, obs_space, act_space)
        if reason is not None:
            self._skip(str(getattr(ep, "id_", "?")), f"episode {getattr(ep, 'id_', '?')}: {reason}")
            return False
        return True

    @staticmethod
    def _module_columns(batch: dict[str, np.ndarray]) -> list[np.ndarray] | str:
        """The columns an agent row's module is checked against (`_module_agrees`), taken once per
        batch: its id columns and folder, or why every row of it fails (a column it lacks)."""
        from rlrec.trainer.multi_agent import FOLDER, ID_COLUMNS

        missing = [c for c in (*ID_COLUMNS, FOLDER) if c not in batch]
        if missing:
            return f"its row lacks {missing[0]!r}"
        return [batch[c] for c in (*ID_COLUMNS, FOLDER)]

    def _module_agrees(self, ep: Any, columns: list[np.ndarray] | str, i: int) -> bool:
        """Whether agent row `i`'s module agrees with its row's `columns` (`_module_columns`) and
        the folder it was read from (`rlrec.trainer.multi_agent.row_module_mismatch`), and its
        episode id with its agent and multi-agent episode ids
        (`rlrec.trainer.multi_agent.agent_id_mismatch`); else it is skipped and counted."""
        from rlrec.trainer.multi_agent import agent_id_mismatch, row_module_mismatch

        if isinstance(columns, str):
            reason: str | None = columns
        else:
            values = [c[i] for c in columns]
            reason = row_module_mismatch(getattr(ep, "module_id", None), *values, self._rlrec_policy_id)
            reason = reason or agent_id_mismatch(
                getattr(ep, "id_", None), getattr(ep, "multi_agent_episode_id", None), getattr(ep, "agent_id", None)
            )
        if reason is None:
            return True
        self._skip(str(getattr(ep, "id_", "?")), f"agent episode {getattr(ep, 'id_', '?')}: {reason}")
        return False

    def _decode(self, batch: dict[str, np.ndarray]) -> list:
        from rlrec.store.episodes import EpisodeDecodeError, unpack_episode

        tags = batch.get(TAG)
        module_columns = self._module_columns(batch) if self._rlrec_multi_agent else []
        episodes = []
        for i, item in enumerate(batch["item"]):
            try:
                ep = unpack_episode(bytes(item))
            except EpisodeDecodeError as e:
                self._skip(f"#{i}", f"cannot be decoded safely: {e}")
                continue
            if self._rlrec_multi_agent and not self._module_agrees(ep, module_columns, i):
                continue
            if self._rlrec_env_flags:  # the env's own last flags, not RLlib's; not terminated: truncated
                ep.is_terminated = bool(batch["env_terminated"][i])
                ep.is_truncated = not ep.is_terminated
            if not self._usable(ep) or self._held_out(ep):  # unusable ones are counted, held out or not
                continue
            for k in [k for k in ep.extra_model_outputs if k not in self._rlrec_keep]:
                del ep.extra_model_outputs[k]
            if tags is not None:
                _tag_episode(ep, int(tags[i]))
            episodes.append(ep)
        return episodes

    def _postprocess_and_sample(self, episodes: list) -> list:
        """RLlib's version, except that sampled transitions keep their extra model outputs
        (RLlib drops them: ``include_extra_model_outputs`` defaults to False), so the tag
        survives. All other extra outputs were removed in `_decode` unless kept on purpose.
        Multi-agent rows go to per-module buffers that keep the agent and module ids
        (`rlrec.trainer.multi_agent_buffer.ModuleEpisodeBuffers`; they drop repeats themselves)."""
        buffer = self._rlrec_buffer()
        episodes = episodes if buffer is self._rlrec_module_buffers else self._validate_episodes(episodes)
        if self._module.is_stateful() and not self.config.prelearner_use_recorded_module_states:
            from ray.rllib.core.columns import Columns

            for eps in episodes:
                eps.extra_model_outputs.pop(Columns.STATE_OUT, None)
                eps.extra_model_outputs.pop(Columns.STATE_IN, None)
        buffer.add(episodes)
        batch_length_T = self.config.model_config.get("max_seq_len", 0) if self._module.is_stateful() else None
        kw = {
            "num_items": self.config.train_batch_size_per_learner,
            "batch_length_T": batch_length_T,
            "n_step": self.config.get("n_step", 1),
            "sample_episodes": True,
            "to_numpy": True,
            "lookback": self.config.episode_lookback_horizon,
            "min_batch_length_T": getattr(self.config, "burnin_len", 0),
        }
        try:
            return buffer.sample(include_extra_model_outputs=True, **kw)
        except TypeError:  # a custom buffer class without that option (no shard tracking then)
            return buffer.sample(**kw)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.rlrec_last_skips = []
        self.rlrec_last_usable = None  # episodes of this batch left to train on (set below)
        if self.config.input_read_episodes:
            episodes = self._decode(batch)
            self.rlrec_last_usable = len(episodes)
            if self._rlrec_mode == "buffer":
                if episodes or self._rlrec_buffer().get_num_timesteps() > 0:
                    episodes = self._postprocess_and_sample(episodes)
            elif self._module.is_stateful() and not self.config.prelearner_use_recorded_module_states:
                from ray.rllib.core.columns import Columns

                for eps in episodes:
                    eps.extra_model_outputs.pop(Columns.STATE_OUT, None)
                    eps.extra_model_outputs.pop(Columns.STATE_IN, None)
        else:
            from ray.rllib.offline.offline_prelearner import SCHEMA

            schema = SCHEMA | (self.config.input_read_schema or {})
            known = set(schema) | set(schema.values()) | self._rlrec_keep | {TAG}
            batch = {k: v for k, v in batch.items() if k in known}
            episodes = [
                ep
                for ep in self._map_to_episodes(batch, to_numpy=False)["episodes"]
                if self._usable(ep) and not self._held_out(ep)
            ]
            self.rlrec_last_usable = len(episodes)
        if not episodes:
            return {}
        out = self._learner_connector(rl_module=self._module, batch={}, episodes=episodes, shared_data={}, metrics=None)
        for module_id in list(out):
            if not self._should_module_be_updated(module_id, out):
                del out[module_id]
        return flatten_dict(out)


_envelope_classes: dict[type, type] = {}


def envelope_prelearner_class(cls: type) -> type:
    """`cls` (an OfflinePreLearner class) taking and returning envelopes (see above), and
    reporting to the feed how many rows it produced from which chunks."""
    if cls in _envelope_classes:
        return _envelope_classes[cls]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, **kwargs)
        spec = (kwargs["config"].learner_config_dict or {}).get(LEARNER_CONFIG_KEY, {})
        self._rlrec_feed = get_feed(spec) if spec.get("feed") else None

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        outs, rows = [], []
        for env, tag in zip(batch[ENVELOPE], batch[TAG]):
            out = cls.__call__(self, ipc_to_numpy_batch(bytes(env)))
            outs.append(pack_columns(out) if out else b"")
            rows.append(row_count(out) if out else 0)
            if self._rlrec_feed is not None:
                skips = getattr(self, "rlrec_last_skips", None)
                if skips:  # before `processed`: the feed still knows which chunk the tag was
                    self._rlrec_feed.skipped.remote(int(tag), [e for e, _ in skips], skips[0][1])
                # a chunk with no episode left to train on (all held out or unusable) reports no
                # rows, whatever rows the call returned: in "buffer" mode they are sampled from
                # earlier chunks' episodes (other shards' tags), and the shard of this one must
                # count as trained on now (`FeedState.processed`), not wait for rows never coming
                usable = getattr(self, "rlrec_last_usable", None)
                self._rlrec_feed.processed.remote([int(tag)], 0 if usable == 0 else rows[-1])
        # an Arrow table, not a numpy object array: Ray Data sizes Arrow blocks exactly, so each
        # one-row envelope leaves the actor at once (object arrays were held back, unsized)
        return pa.table({ENVELOPE: pa.array(outs, type=pa.binary()), "rlrec_rows": pa.array(rows, type=pa.int64())})

    wrapped = type(f"Envelope{cls.__name__}", (cls,), {"__init__": __init__, "__call__": __call__})
    _envelope_classes[cls] = wrapped
    return wrapped
