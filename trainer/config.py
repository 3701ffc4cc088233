"""The trainer's options: :class:`TrainerConfig`, the one declaration of ``rlrec train``'s settings.

Each field declared with :func:`rlrec.options.option` is an option of ``rlrec train``: its
``--flag``, its ``RLREC_*`` variable, its config-file key and its row in docs/CONFIG.md come from
it. Standard library only (``rlrec --help`` imports it); ``rlrec.trainer.service`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rlrec.options import check_choices, option
from rlrec.trainer.feed import FeedPolicy

__all__ = ["ALGORITHM_NAMES", "OPESettings", "TrainerConfig", "training_settings"]

Algorithm = Literal["BC", "MARWIL", "CQL", "IQL"]
#: the algorithms `rlrec train` can run (their RLlib classes: ``rlrec.trainer.service.ALGORITHMS``)
ALGORITHM_NAMES: tuple[str, ...] = Algorithm.__args__
#: the most episodes one evaluation (--eval-episodes, --promotion-episodes) plays
MAX_EVALUATION_EPISODES = 100_000


#: common names for RLlib settings that difflib would not find
_ALGO_CONFIG_ALIASES = {
    "learning_rate": "lr",
    "batch_size": "train_batch_size_per_learner",
    "train_batch_size": "train_batch_size_per_learner",
    "discount": "gamma",
}


def training_settings(config_cls: type) -> set[str]:
    """The keyword arguments ``config_cls().training(...)`` accepts: the named parameters of
    ``training`` in the class and every base class (a subclass passes the rest up).

    Args:
        config_cls: an RLlib ``AlgorithmConfig`` subclass.

    Example:
        >>> from ray.rllib.algorithms.bc import BCConfig
        >>> {"lr", "train_batch_size_per_learner", "beta"} <= training_settings(BCConfig)
        True
    """
    import inspect

    names: set[str] = set()
    for cls in config_cls.__mro__:
        fn = cls.__dict__.get("training")
        if fn is None:
            continue
        for name, p in inspect.signature(fn).parameters.items():
            if name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                names.add(name)
    return names


Estimator = Literal["auto", "wdr", "fqe", "wpdis", "wis", "mb"]
PromotionGate = Literal["off", "env", "ope"]
Rollout = Literal["direct", "canary"]


def _gate_value(text: str) -> str:
    return str(text).strip().lower()


@dataclass
class OPESettings:
    """Off-policy evaluation settings shared by `rlrec train` (the held-out split, the ``ope``
    promotion gate) and `rlrec evaluate`: the same names, variables and file keys for both."""

    holdout_fraction: float = option(
        0.1,
        help="share of episodes held out for evaluation, chosen by a hash of the episode id (sha256, "
        "first 8 bytes / 2**64 < F); train never trains on them, evaluate reads only them; 0: none",
    )
    ope_ci: float = option(0.9, help="level of the bootstrap confidence intervals of off-policy estimates")
    ope_bootstrap: int = option(500, help="bootstrap resamples (over episodes) of off-policy estimates")
    ope_min_episodes: int = option(10, help="an off-policy estimate needs at least this many held-out episodes")
    ope_min_coverage: float = option(
        0.9, help="least share of held-out steps with a behaviour propensity (action_logp) for wis, wpdis, wdr"
    )
    ope_max_support: float = option(
        0.1,
        help="most candidate probability on actions the behaviour takes with probability < 0.01 (all estimators)",
    )
    ope_min_ess: float = option(10.0, help="least effective sample size of the episode weights (wis, wpdis)")
    ope_max_weight: float = option(0.25, help="largest share of the weight one episode may carry (wis, wpdis)")
    ope_max_is_horizon: float = option(
        100.0, help="longest mean episode length pure importance sampling (wis, wpdis) is trusted on"
    )
    fqe_steps: int | None = option(None, help="FQE gradient steps (default: 30 / (1 - gamma), 1000 to 5000)")
    ope_min_step_ess: float = option(
        10.0,
        help="gate verdict: t* is the first step where the importance weights' effective sample size "
        "falls below this (wdr, wpdis, wis)",
    )
    ope_max_tail_share: float = option(
        0.25,
        help="gate verdict: an estimate with more than this discounted share of its value beyond t* "
        "(resting on the model, or on too few episodes) may not decide a publication",
    )

    mb_members: int = option(
        5, help="mb: ensemble members (refits on bootstrap resamples of the episodes, each with its own seed)"
    )
    mb_steps: int = option(1500, help="mb: gradient steps per ensemble member")
    mb_max_offdata_share: float = option(
        0.2,
        help="mb gate verdict: most discounted share of the candidate's rolled-out horizon after its "
        "states left the logged data",
    )

    def model(self, seed: int) -> Any:
        """The `rlrec.trainer.ope_model.ModelConfig` of ``mb`` these settings give."""
        from rlrec.trainer.ope_model import ModelConfig

        return ModelConfig(
            members=self.mb_members, steps=self.mb_steps, max_offdata_share=self.mb_max_offdata_share, seed=seed
        )

    def __post_init__(self) -> None:
        from rlrec.trainer.holdout import check_fraction

        check_fraction(self.holdout_fraction)
        if not 0.0 < self.ope_ci < 1.0:
            raise ValueError(f"--ope-ci must be in (0, 1), got {self.ope_ci}")
        if self.ope_bootstrap < 10:
            raise ValueError("--ope-bootstrap must be >= 10")
        if not 0.0 <= self.ope_max_tail_share <= 1.0:
            raise ValueError(f"--ope-max-tail-share must be in [0, 1], got {self.ope_max_tail_share}")
        if self.mb_members < 1 or self.mb_steps < 1:
            raise ValueError("--mb-members and --mb-steps must be >= 1")

    def thresholds(self) -> Any:
        """The `rlrec.trainer.ope.Thresholds` these settings give."""
        from rlrec.trainer.ope import Thresholds

        return Thresholds(
            min_episodes=self.ope_min_episodes,
            min_coverage=self.ope_min_coverage,
            max_support=self.ope_max_support,
            min_ess=self.ope_min_ess,
            max_weight=self.ope_max_weight,
            max_is_horizon=self.ope_max_is_horizon,
            min_step_ess=self.ope_min_step_ess,
            max_tail_share=self.ope_max_tail_share,
        )


@dataclass
class TrainerConfig:
    """Options of `rlrec train` (names match the CLI flags); the fields without help are settings
    for programs and tests only."""

    input: str = option(help="the consumer's output URI or path (its manifest is followed)")
    checkpoint_dir: str = option(help="URI or path for checkpoints, metrics.jsonl and policies")
    algo: Algorithm = option("BC", help="the RLlib offline algorithm (any case)", normalize=str.upper)
    env: str | None = option(
        None,
        help="gymnasium env id for evaluation rollouts (spaces otherwise come from the shards); with "
        "--multi-agent: pettingzoo:MODULE (a PettingZoo Parallel env), pettingzoo-aec:MODULE or "
        "MODULE:CLASS (an RLlib MultiAgentEnv)",
    )
    env_config: dict[str, Any] = option(
        default_factory=dict,
        help="with --multi-agent --env: the env's keyword arguments, e.g. N=2 (the config dict of a "
        "MultiAgentEnv class; a table in a config file)",
    )
    resume: bool = option(False, help="continue from the latest checkpoint in --checkpoint-dir")
    num_learners: int = option(0, help="remote Learner actors (0: train in this process)")
    num_gpus_per_learner: float = option(0.0, help="GPUs per Learner")
    eval_interval: int = option(0, help="evaluate every K iterations (needs --env; 0: never)")
    eval_episodes: int = option(5, help="episodes per evaluation")
    max_iterations: int | None = option(
        None, help="stop after this many iterations (total, across resumes; default: never)"
    )
    checkpoint_interval: int = option(10, help="checkpoint + publish every N iterations")
    keep_checkpoints: int = option(3, help="checkpoints to keep")
    algo_config: dict[str, Any] = option(
        default_factory=dict,
        help="AlgorithmConfig.training() option, e.g. lr=1e-3, train_batch_size_per_learner=512 "
        "(values are JSON or Python literals; a table in a config file)",
    )
    offline_config: dict[str, Any] = option(
        default_factory=dict,
        help="AlgorithmConfig.offline_data() option, e.g. dataset_num_iters_per_learner=20 (a table in a config file)",
    )
    map_batches_concurrency: int | None = option(
        None, help="PreLearner actors (map_batches concurrency; default: 1, which works on a 2-CPU machine)"
    )
    policy_id: str | None = option(None, help="train on this policy's shards only")
    min_policy_version: int | None = option(
        None, help="train on episodes recorded by this policy version or newer only (per episode)"
    )
    max_policy_version: int | None = option(
        None, help="train on episodes recorded by this policy version or older only (per episode)"
    )
    wait_for_data: bool = option(
        False, help="train only while fresh shards are waiting (off: keep training on the replay window)"
    )
    first_shard_timeout_s: float | None = option(
        None,
        help="exit (code 1, one error line saying why) when no committed shard appears within this many "
        "seconds of the start (scripts); default: wait, saying why every 30 s",
    )
    min_time_s_per_iteration: float = option(1.0, help="RLlib min_time_s_per_iteration")
    fresh_fraction: float = option(0.5, help="share of reads going to fresh shards while a backlog exists (0 < f <= 1)")
    replay_shards: int | None = option(None, help="replay window: the N most recent trained shards")
    replay_max_age_s: float | None = option(None, help="replay window: shards committed within this many seconds")
    replay_policy_versions: int | None = option(None, help="replay window: shards of the K newest policy versions")
    prelearner_mode: Literal["episodes", "buffer"] = option(
        "episodes",
        help="episodes: every timestep of each read chunk, shuffled at the Learner; buffer: RLlib's "
        "PreLearner episode-buffer sampling",
    )
    multi_agent: bool = option(
        False,
        help="train every module of multi-agent episodes (BC, MARWIL): the modules, their spaces and the "
        "agent->module mapping come from the store's {policy}.{module} folders (docs/TRAINER.md, 'Multi-agent "
        "training'); one published version holds all modules",
    )
    multi_agent_flags: Literal["rllib", "env"] = option(
        "rllib",
        help="with --multi-agent, the ending flags the learner sees: rllib, RLlib's per-agent flags (an agent "
        "the env left is terminated); env, terminated only where the env terminated the agent, else truncated "
        "(MARWIL's GAE reads them)",
    )
    poll_interval_s: float = 0.5
    cache_ttl_s: float = 30.0
    stall_timeout_s: float = option(
        300.0,
        help="exit (code 70, one error line) when fresh shards wait and no fresh data is trained for this many "
        "seconds after the first iteration while the input store answers (a worker, the feed or a Learner "
        "lost and not back); 0: never",
    )
    publish: bool = option(True, help="publish each checkpointed policy (--no-publish: don't)")
    publish_dir: str | None = option(None, help="where to publish policies (default: {checkpoint-dir}/policies)")
    channel: str | None = option(
        None,
        help="what the published policies are for, signed into each version and the latest pointer; services "
        "pin it (load_policy(channel=...)) and refuse versions of other channels (default: --policy-id, "
        "else 'default')",
    )
    metrics_port: int | None = option(
        None, help="serve the metrics on a Prometheus endpoint on this port (0: pick a free port; default: no server)"
    )
    metrics_host: str = option("127.0.0.1", help="interface for the metrics server (0.0.0.0 in containers)")
    progress: bool = True
    num_cpus: int | None = option(
        None, help="CPUs of the Ray this command starts (default: all); not with --ray-address/RAY_ADDRESS"
    )
    ray_address: str | None = option(
        None,
        help="join a running Ray cluster (GCS address host:port, or auto) instead of starting Ray here; "
        "default: $RAY_ADDRESS. rlrec must be installed on every node (same image) or shipped with "
        "--ray-runtime-env py_modules; AWS_*/GOOGLE_*/AZURE_* settings are forwarded to the workers "
        "as runtime_env env_vars (visible in the Ray dashboard: prefer instance roles for credentials)",
    )
    ray_runtime_env: dict | str | None = option(
        None,
        metavar="JSON",
        help='extra runtime_env for the job, e.g. \'{"py_modules": ["dist/rlrec-0.1.0-py3-none-any.whl"]}\' '
        "(a table in a config file)",
    )
    read_tasks: int = option(
        1, help="never-ending read tasks sharing the shard feed (more help when reading shards is the limit)"
    )
    seed: int | None = option(None, help="random seed of the algorithm and the shard feed (default: unseeded)")
    idle_log_interval_s: float = 30.0
    promotion_gate: PromotionGate | None = option(
        None,
        const="env",
        normalize=_gate_value,
        help="publish a checkpoint's policy only if it is not worse than the deployed version (the flag alone: "
        "env): env plays it "
        "greedily for --promotion-episodes episodes of --env; ope estimates it off-policy on the held-out "
        "episodes (no simulator): the lower bound of the paired difference candidate - deployed must be "
        ">= -(--promotion-margin); decisions go to metrics.jsonl and the published policy.json. Default: env "
        "when --env is given, else ope with --rollout canary (nothing reaches latest.json unjudged); off "
        "publishes every checkpoint's policy, the stop's included",
    )
    promotion_baseline: float | None = option(
        None, help="with --promotion-gate env: the return of what is deployed before the first publication"
    )
    promotion_episodes: int = option(10, help="episodes per promotion evaluation")
    promotion_return: str = option(
        "sum",
        help="with --multi-agent --promotion-gate env: the return the gate judges: sum (every agent's rewards; "
        "refused when it is 0 in every episode while the agents' are not: a zero-sum env) or module:ID (that "
        "module's agents' rewards)",
    )
    promotion_estimator: Estimator = option(
        "auto",
        help="with --promotion-gate ope: the off-policy estimator; auto: wdr where its gate verdict holds "
        "(short horizons), else mb (pessimistic model-based); fqe never passes the gate verdict",
    )
    promotion_margin: float = option(
        0.0, help="with --promotion-gate ope: the candidate may be this much worse (discounted return) at the bound"
    )
    promotion_explore: bool = option(
        False, help="with --promotion-gate ope: evaluate the exploring policy (default: its greedy actions)"
    )
    ope_report: bool = option(
        False,
        help="estimate each checkpoint's candidate off-policy (--promotion-estimator, on the held-out "
        "episodes, in the background) and log it in metrics.jsonl as ope_report, beside its true "
        "discounted return when --env is given; decides nothing (the ope gate's decisions carry "
        "their estimates already)",
    )
    evaluation_wait_s: float = option(
        60.0,
        help="at a stop, wait this long for a running off-policy evaluation (--promotion-gate ope, "
        "--ope-report) and apply it; after that it is dropped and its candidate is not published",
    )
    rollout: Rollout | None = option(
        None,
        help="direct: a candidate that passes the promotion gate moves latest.json; canary: it is published "
        "to canary.json, served by services that opt in (load_policy(canary_fraction=...)) to a share of "
        "episodes, and promoted or rolled back by an always-valid sequential test of its discounted returns "
        "against the deployed version's (docs/DEPLOY.md, 'Canary rollout'). Default: canary where "
        "--promotion-gate is not given and resolves to ope, else direct",
    )
    canary_unjudged: bool = option(
        False,
        help="with --rollout canary and --promotion-gate ope: put on canary a candidate the offline gate "
        "declined to judge (a refusal code with judged false, e.g. too little overlap; not 'failed') instead "
        "of dropping it; a candidate the gate judged worse is never put on canary",
    )
    canary_share: float = option(
        0.05,
        help="with --rollout canary: the test's share g of each service's episodes: it counts canary episodes "
        "whose score is below g and deployed ones whose score is at least 0.5, of services serving a "
        "canary_fraction between g and 0.5 (so services at different fractions give both arms the same shares); "
        "set it to the smallest canary_fraction your services serve",
    )
    canary_alpha: float = option(
        0.05, help="with --rollout canary: error probability of the canary's test, however often it is checked"
    )
    canary_margin: float = option(
        0.0,
        help="with --rollout canary: promote when the lower bound of canary - deployed (mean discounted return) "
        "is at least -margin",
    )
    canary_min_episodes: int = option(
        30, help="with --rollout canary: episodes each arm needs before the test decides on its bound"
    )
    canary_max_episodes: int = option(
        2000, help="with --rollout canary: roll back a canary still undecided after serving this many episodes"
    )
    canary_max_wait_s: float = option(
        3600.0,
        help="with --rollout canary: roll back a canary that has not got --canary-min-episodes in both arms "
        "after this many seconds, or that got no new canary episode for this long after (logged as: no canary "
        "traffic)",
    )
    canary_return_min: float | None = option(
        None,
        help="with --rollout canary: the least discounted return an episode can have (with --canary-return-max: "
        "the test's range; a canary return below it rolls the canary back, a deployed return above it forbids a "
        "promotion, other returns outside it are clipped and counted). Default: the range of the episodes "
        "before the canary started, widened by a quarter of it on each side",
    )
    canary_return_max: float | None = option(
        None, help="with --rollout canary: the greatest discounted return an episode can have (see --canary-return-min)"
    )
    canary_episode_max_s: float | None = option(
        None,
        help="with --rollout canary: the longest an episode takes from its start until its shard is committed, "
        "for partitions whose consumer keeps no watermark (an older rlrec): there the test counts only episodes "
        "that started at least this long ago (a complete cohort, so slow episodes -- often the failures -- are not "
        "missing from it); partitions with one count up to their watermark (docs/GUARANTEES.md, 'Watermark'). "
        "The wait for traffic counts from start + this. Default: twice the longest episode before the canary "
        "started, at least 900 s",
    )
    canary_max_duration_s: float = option(
        7 * 86400.0, help="with --rollout canary: roll back a canary still undecided this long after it started"
    )
    canary_look_interval_s: float = 10.0
    publish_lease_s: float = 30.0
    ope: OPESettings = field(default_factory=OPESettings)
    signing_key: str | None = option(
        None,
        help="Ed25519 private key (PEM; `rlrec keys generate DIR` writes DIR/policy-signing.key): signs each "
        "published policy.json (policy.json.sig) and each checkpoint's index.json; --resume then refuses a "
        "checkpoint whose files do not match its signed index",
    )

    def __post_init__(self) -> None:
        if isinstance(self.promotion_gate, bool):
            self.promotion_gate = "env" if self.promotion_gate else "off"
        check_choices(self)
        #: why the promotion gate and rollout are what they are (said at start)
        self.gate_default: str | None = None
        buffer_class = self.offline_config.get("prelearner_buffer_class")
        if buffer_class is not None and not isinstance(buffer_class, type):  # RLlib's validate: a TypeError
            raise ValueError(
                f"--offline-config prelearner_buffer_class: {buffer_class!r:.80} is not a class: give an "
                "EpisodeReplayBuffer subclass (Python API) or leave it unset"
            )
        if self.multi_agent:
            self._check_multi_agent()
        elif self.multi_agent_flags != "rllib":
            raise ValueError(
                f"--multi-agent-flags {self.multi_agent_flags} sets the flags of multi-agent rows: it needs --multi-agent"
            )
        elif self.env_config:
            raise ValueError("--env-config gives a multi-agent env its arguments: it needs --multi-agent")
        if self.env_config and not self.env:
            raise ValueError("--env-config gives --env its arguments: it needs --env")
        head, _, module = self.promotion_return.partition(":")
        if not (self.promotion_return == "sum" or (head == "module" and module)):
            raise ValueError(f"--promotion-return {self.promotion_return!r:.60} is sum or module:ID")
        if self.promotion_return != "sum" and not self.multi_agent:
            raise ValueError(
                "--promotion-return module:ID judges one module of a multi-agent env: it needs --multi-agent"
            )
        if self.promotion_gate is None:
            self.promotion_gate = self._default_gate()
            self.gate_default = {
                "off": "--promotion-gate off: every checkpoint's policy is published (--multi-agent without --env)"
                if self.publish
                else "--promotion-gate off: nothing is published (--no-publish)",
                "env": "--promotion-gate env: the default with --env",
                "ope": "--promotion-gate ope --rollout canary: the default without --env (no simulator: judged "
                "off-policy, then proved on live traffic; --promotion-gate off publishes every checkpoint)",
            }[self.promotion_gate]
            if self.rollout is None and self.promotion_gate == "ope":
                self.rollout = "canary"
        if self.rollout is None:
            self.rollout = "direct"
        if self.checkpoint_interval < 1:
            raise ValueError("checkpoint_interval must be >= 1")
        if self.stall_timeout_s < 0:
            raise ValueError("--stall-timeout-s must be >= 0")
        if self.eval_interval and not self.env:
            raise ValueError("--eval-interval needs --env (evaluation runs episodes in the environment)")
        if self.promotion_gate == "env" and not self.env:
            raise ValueError(
                "--promotion-gate env needs --env (candidates are evaluated in the environment; "
                "--promotion-gate ope needs no simulator)"
            )
        if self.promotion_gate == "ope" and not self.ope.holdout_fraction:
            raise ValueError("--promotion-gate ope needs held-out episodes: --holdout-fraction > 0")
        if self.ope_report and not self.ope.holdout_fraction:
            raise ValueError("--ope-report needs held-out episodes: --holdout-fraction > 0")
        if self.ope_report and not self.publish:
            raise ValueError("--ope-report estimates the candidates of published checkpoints: not with --no-publish")
        if self.evaluation_wait_s < 0:
            raise ValueError("--evaluation-wait-s must be >= 0")
        if self.rollout == "canary":
            if not self.publish:
                raise ValueError("--rollout canary publishes candidates to the canary pointer: not with --no-publish")
            if not self.gate:
                raise ValueError(
                    "--rollout canary puts on canary the candidates a promotion gate passes: not with "
                    "--promotion-gate off"
                )
            self.canary_rule()  # its own checks
        elif self.canary_unjudged:
            raise ValueError("--canary-unjudged needs --rollout canary")
        for flag, n in (("--promotion-episodes", self.promotion_episodes), ("--eval-episodes", self.eval_episodes)):
            if not 1 <= n <= MAX_EVALUATION_EPISODES:  # 0 judges on nothing; a huge one never ends
                raise ValueError(f"{flag} must be between 1 and {MAX_EVALUATION_EPISODES:,}, got {n}")
        if self.num_learners < 0:
            raise ValueError("--num-learners must be >= 0")
        if self.num_gpus_per_learner < 0:
            raise ValueError("--num-gpus-per-learner must be >= 0")
        if self.map_batches_concurrency is not None and self.map_batches_concurrency < 1:
            raise ValueError("--map-batches-concurrency must be >= 1")
        if self.read_tasks < 1:
            raise ValueError("--read-tasks must be >= 1")
        if self.channel is not None:
            from rlrec.trainer.binding import check_name

            check_name(self.channel, "--channel")
        self.feed_policy()  # its own checks (--fresh-fraction, the replay window), before Ray starts
        from rlrec.trainer.cluster import RayPlacement

        #: how this trainer gets its Ray (raises ClusterConfigError, a ValueError, on contradictions)
        self.placement = RayPlacement.resolve(self.ray_address, self.num_cpus, self.ray_runtime_env)

    def check_inputs(self) -> None:
        """Check what can be checked before Ray starts: the ``--env`` id (gymnasium's own
        "did you mean"), the ``--algo-config`` keys (against the algorithm's config class) and
        that a ``--offline-config prelearner_class`` applies ``--holdout-fraction``
        (`rlrec.trainer.data.check_holdout_prelearner`).

        Raises:
            rlrec.errors.UsageError: one line naming the option and the nearest valid name.

        Example:
            >>> TrainerConfig(input="/d", checkpoint_dir="/c", env="CartPol-v1").check_inputs()
            Traceback (most recent call last):
            ...
            rlrec.errors.UsageError: --env 'CartPol-v1': Environment `CartPol` doesn't exist. Did you mean: `CartPole`?
        """
        from rlrec.errors import UsageError

        pre = self.offline_config.get("prelearner_class")
        if pre is not None and self.ope.holdout_fraction:
            from rlrec.trainer.data import check_holdout_prelearner
            from rlrec.trainer.service import _import

            try:
                check_holdout_prelearner(_import(pre) if isinstance(pre, str) else pre, self.ope.holdout_fraction)
            except (ImportError, AttributeError, ValueError) as e:
                raise UsageError(f"--offline-config prelearner_class: {e}") from None
        if self.env and self.multi_agent:
            from rlrec.trainer.multi_agent_env import EnvSpecError, make_env

            try:
                make_env(self.env, self.env_config).close()
            except EnvSpecError as e:
                raise UsageError(str(e)) from None
        elif self.env:
            import importlib

            import gymnasium as gym

            try:
                if ":" in self.env:  # "module:EnvName-v0": gymnasium.make imports the module first
                    importlib.import_module(self.env.split(":", 1)[0])
                gym.spec(self.env)
            except (gym.error.Error, ImportError) as e:
                raise UsageError(f"--env {self.env!r}: {e}") from None
        if self.algo_config:
            import difflib

            from rlrec.trainer.service import ALGORITHMS, _import

            config_cls = _import(ALGORITHMS[self.algo][0])
            known = training_settings(config_cls)
            for key in self.algo_config:
                if key in known:
                    continue
                near = _ALGO_CONFIG_ALIASES.get(key) or next(
                    iter(difflib.get_close_matches(key, sorted(known), 1)), None
                )
                hint = f" (did you mean {near!r}?)" if near else ""
                raise UsageError(
                    f"--algo-config: {key!r} is no setting of RLlib's {config_cls.__name__}{hint}; "
                    "see AlgorithmConfig.training()"
                )

    @property
    def publish_channel(self) -> str:
        """The channel policies are published for: ``--channel``, else ``--policy-id``, else ``default``."""
        from rlrec.trainer.binding import DEFAULT_CHANNEL

        return self.channel or self.policy_id or DEFAULT_CHANNEL

    @property
    def gate(self) -> bool:
        """Whether a promotion gate is on."""
        return self.promotion_gate != "off"

    def _default_gate(self) -> str:
        """The promotion gate without ``--promotion-gate``: env with ``--env``, else ope (with the canary)."""
        if not self.publish:
            return "off"
        if self.env:
            return "env"
        if self.multi_agent:
            return "off"
        if self.ope.holdout_fraction:
            return "ope"
        raise ValueError(
            "no promotion gate can judge candidates without --env and with --holdout-fraction 0: give --env, "
            "--holdout-fraction > 0 (the default), or --promotion-gate off to publish every checkpoint's policy"
        )

    def _check_multi_agent(self) -> None:
        """What ``--multi-agent`` cannot do yet: one ValueError line each."""
        if self.algo not in ("BC", "MARWIL"):
            raise ValueError(f"--multi-agent trains BC or MARWIL; {self.algo} is not supported with it yet")
        if self.promotion_gate == "ope":
            raise ValueError(
                "--promotion-gate ope is single-agent only: not with --multi-agent (give --env and "
                "--promotion-gate env, or --promotion-gate off to publish every checkpoint's policy)"
            )
        if self.eval_interval:
            raise ValueError(
                "--eval-interval is single-agent only: with --multi-agent, --promotion-gate env evaluates each "
                "checkpoint's candidate in --env"
            )
        if self.rollout == "canary" or self.ope_report:
            raise ValueError("--rollout canary and --ope-report are single-agent only: not with --multi-agent")
        if not self.offline_config.get("input_read_episodes", True):
            raise ValueError(
                "--offline-config input_read_episodes=false reads tabular shards; multi-agent rows are episode "
                "rows: not with --multi-agent"
            )
        if self.offline_config.get("prelearner_class") is not None:
            raise ValueError(
                "--offline-config prelearner_class: --multi-agent reads its rows with rlrec's own PreLearner "
                "(per-module checks, held-out split, env flags): not with --multi-agent"
            )
        if self.prelearner_mode == "buffer":
            why = _module_buffer_class_refusal(self.offline_config.get("prelearner_buffer_class"))
            if why is not None:
                raise ValueError(
                    f"--offline-config prelearner_buffer_class with --multi-agent --prelearner-mode buffer: {why}"
                )

    def canary_rule(self) -> Any:
        """The canary's test (`rlrec.trainer.sequential.CanaryRule`); ValueError on a bad setting."""
        from rlrec.trainer.sequential import CanaryRule

        return CanaryRule(
            alpha=self.canary_alpha,
            margin=self.canary_margin,
            min_episodes=self.canary_min_episodes,
            max_exposure=self.canary_max_episodes,
            max_wait_s=self.canary_max_wait_s,
            return_min=self.canary_return_min,
            return_max=self.canary_return_max,
            episode_max_s=self.canary_episode_max_s,
            max_duration_s=self.canary_max_duration_s,
            share=self.canary_share,
        )

    def feed_policy(self) -> FeedPolicy:
        """The shard feed's sampling settings these options give."""
        return FeedPolicy(
            fresh_fraction=self.fresh_fraction,
            replay_shards=self.replay_shards,
            replay_max_age_s=self.replay_max_age_s,
            replay_policy_versions=self.replay_policy_versions,
            seed=self.seed,
        )


def _module_buffer_class_refusal(cls: Any) -> str | None:
    """Why `cls` cannot be a module's buffer in multi-agent buffer mode (None: it can): the ids
    are restored by the sampled episode's ``id_``, which only `EpisodeReplayBuffer`'s own
    sampling keeps (prioritized buffers build samples with fresh ids; multi-agent buffers take
    `MultiAgentEpisode`s, and a module's buffer gets agent episodes).

    Example:
        >>> _module_buffer_class_refusal(None) is None
        True
    """
    if cls is None:
        return None
    from ray.rllib.utils.replay_buffers import (
        EpisodeReplayBuffer,
        MultiAgentEpisodeReplayBuffer,
        PrioritizedEpisodeReplayBuffer,
    )

    if not issubclass(cls, EpisodeReplayBuffer):
        return f"{cls.__name__:.80} is not an EpisodeReplayBuffer"
    for bad in (PrioritizedEpisodeReplayBuffer, MultiAgentEpisodeReplayBuffer):
        if issubclass(cls, bad):
            return (
                f"{cls.__name__:.80} is a {bad.__name__}: each module's buffer must be an EpisodeReplayBuffer "
                "that keeps a sampled episode's id (its agent and module ids are restored by it)"
            )
    return None
