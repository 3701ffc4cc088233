"""Where the trainer's Ray runs: start one on this machine, or join an existing cluster.

`RayPlacement` holds the decision and its checks (docs/DEPLOY.md, "The trainer on a Ray cluster"):

* ``address`` (``--ray-address`` or ``RAY_ADDRESS``) joins a running cluster; ``num_cpus`` is
  then refused (a cluster's resources are fixed when its nodes start).
* Joining a cluster, the storage settings the readers need (``AWS_*``, ``GOOGLE_*``,
  ``AZURE_*``, ``STORAGE_EMULATOR_HOST``) are copied from this process's environment into the
  job's ``runtime_env`` ``env_vars``, so every worker on every node sees them. They are then
  visible in the Ray dashboard and job metadata: prefer instance roles / workload identity to
  secrets in the environment.
* rlrec's code reaches the workers because it is installed on every node (the same image), or
  through ``runtime_env`` ``py_modules`` given with ``--ray-runtime-env``.
* `check_input_reachable`: a plain local path cannot be read by a task on another node (it would
  find nothing there and mark the shard missing), so it is refused on a cluster of more than one
  node; a ``file://`` URI declares a shared mount (same path on every node) and is accepted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ClusterConfigError",
    "RayPlacement",
    "alive_nodes",
    "check_input_reachable",
    "is_node_local_path",
    "storage_env",
]

#: environment variables the pyarrow / boto filesystems read (S3, GCS, Azure): forwarded to the workers
STORAGE_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")
STORAGE_ENV_NAMES = ("STORAGE_EMULATOR_HOST",)


class ClusterConfigError(ValueError):
    """The Ray settings cannot work (refused before or right after connecting)."""


def storage_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The storage settings in `environ` (default: this process's) that workers need."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(STORAGE_ENV_PREFIXES) or k in STORAGE_ENV_NAMES}


def is_node_local_path(uri: str) -> bool:
    """True for a plain path (no scheme): it names a directory on this node only.
    ``file:///...`` is taken as a shared mount, present at the same path on every node."""
    return "://" not in str(uri)


def check_input_reachable(uri: str, alive_nodes: int, *, what: str = "--input") -> None:
    """Refuse a node-local input path when the cluster has more than one node."""
    if alive_nodes > 1 and is_node_local_path(uri):
        raise ClusterConfigError(
            f"{what} {uri!r} is a local path, but the Ray cluster has {alive_nodes} nodes: a read "
            "task on another node would not find the shards there. Use object storage "
            "(s3://, gs://, abfs://) or a shared mount given as a file:// URI "
            f"(file://{os.path.abspath(uri)} if that directory is the same shared filesystem on "
            "every node)"
        )


@dataclass
class RayPlacement:
    """How `rlrec train` gets its Ray: `init_kwargs()` for ``ray.init``; refuses contradictions.

    address       a running cluster (``ray://`` client addresses are refused: Ray Data's
                  streaming pipeline needs a driver on the cluster); None/``"local"``: start one here.
    num_cpus      CPUs of a Ray started here; refused with an address.
    runtime_env   extra ``runtime_env`` for the job (e.g. ``{"py_modules": [...]}``); its
                  ``env_vars`` are merged over the forwarded storage settings.
    """

    address: str | None = None
    num_cpus: int | None = None
    runtime_env: dict = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        address: str | None,
        num_cpus: int | None,
        runtime_env: dict | str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> RayPlacement:
        env = os.environ if environ is None else environ
        source = "--ray-address"
        if not address:
            address, source = env.get("RAY_ADDRESS") or None, "RAY_ADDRESS"
        if address is not None and address.strip().lower() == "local":
            address = None
        if address is not None and address.startswith("ray://"):
            raise ClusterConfigError(
                f"{source}={address}: Ray Client (ray://) is not supported; run rlrec train on a "
                "node of the cluster (or as a Ray job) with the GCS address, e.g. 10.0.0.5:6379 or auto"
            )
        if address is not None and num_cpus is not None:
            raise ClusterConfigError(
                f"--num-cpus {num_cpus} cannot be used with {source}={address}: it only sizes a Ray "
                "that rlrec train starts itself; a running cluster's CPUs are set when its nodes start "
                "(ray start --num-cpus)"
            )
        if isinstance(runtime_env, str):
            try:
                runtime_env = json.loads(runtime_env) if runtime_env.strip() else {}
            except ValueError as e:
                raise ClusterConfigError(f"--ray-runtime-env is not JSON: {e}") from None
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise ClusterConfigError("--ray-runtime-env must be a JSON object")
        return cls(address=address, num_cpus=num_cpus, runtime_env=dict(runtime_env or {}))

    def job_runtime_env(self, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
        """The job's runtime_env: forwarded storage settings (joining a cluster) + the user's."""
        renv = dict(self.runtime_env)
        env_vars = storage_env(environ) if self.address is not None else {}
        env_vars.update(renv.get("env_vars") or {})
        if env_vars:
            renv["env_vars"] = env_vars
        return renv or None

    def init_kwargs(self, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        kw: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
        if self.address is not None:
            kw["address"] = self.address
        else:  # a Ray of its own, never a cluster someone started on this machine with `ray start`
            kw.update(address="local", num_cpus=self.num_cpus, include_dashboard=False)
        renv = self.job_runtime_env(environ)
        if renv:
            kw["runtime_env"] = renv
        return kw


def alive_nodes() -> list[dict]:
    """The cluster's live nodes (``ray.nodes()`` entries)."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]
