"""The docker-compose.yml model as `docker compose` would see it, for tests without a Docker engine.

Only what the tests need: YAML with anchors and merge keys (PyYAML's safe loader), compose's
variable interpolation for the forms the file uses, and how a service's command is run.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation for the forms this project uses: $$, ${X}, ${X:-d}, ${X-d}, $X."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3)
        value = env.get(name)
        if op == ":-" and not value:
            return default
        if op == "-" and value is None:
            return default
        return value or ""

    return _VAR.sub(sub, text)


def _walk(node, env):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


def load_compose(env: dict[str, str] | None = None) -> dict:
    """The compose model as `docker compose` sees it with *env* (default: no overrides)."""
    return _walk(yaml.safe_load(COMPOSE.read_text()), env or {})


def command_list(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def invocation(service: dict) -> tuple[str | None, list[str]]:
    """(module, argv): module None means the image's entrypoint, `rlrec`; a service whose entrypoint
    is a shell runs `exec python -m MODULE ARGS` (command substitutions stand in as a number)."""
    entry = service.get("entrypoint")
    if entry is None:
        return None, command_list(service)
    assert entry == ["/bin/sh", "-c"], entry
    (script,) = command_list(service)
    words = shlex.split(re.sub(r'"\$\((?:[^()]|\([^()]*\))*\)"', "12345", script))
    assert words[:3] == ["exec", "python", "-m"], script
    return words[3], words[4:]


def created_buckets(init: dict) -> set[str]:
    """The buckets the minio-init service's script makes (`mc mb ... local/BUCKET`), its variables resolved."""
    (script,) = command_list(init)  # compose has turned $$ into $: what the shell gets
    env = env_of(init)
    names = re.findall(r"mc mb [^&;|]*?local/([^\s;&|\"]+)", script)
    return {re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], name) for name in names}
