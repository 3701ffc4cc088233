"""The Dockerfile and .dockerignore as `docker build` would read them, for tests without a Docker engine.

Only what the tests need: instructions (continuations joined, comments dropped), the build
stages, .dockerignore matching, the build context a stage's COPY lines would see, and running a
stage's RUN lines in a directory (outside Docker: for the parts that need no base image).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.compose_model import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        buf += " " + stripped
        if buf.endswith("\\"):
            buf = buf[:-1]
            continue
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


@dataclass
class Stage:
    """One `FROM IMAGE AS NAME` and the instructions up to the next FROM."""

    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def runs(self) -> list[str]:
        return [rest for word, rest in self.instructions if word == "RUN"]

    def copies(self) -> list[list[str]]:
        """Each COPY's words (options such as --from=src first)."""
        return [rest.split() for word, rest in self.instructions if word == "COPY"]


def stages() -> list[Stage]:
    """The build stages in file order (the last is what a plain `docker build .` builds)."""
    out: list[Stage] = []
    for word, rest in instructions():
        if word == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.I)
            assert m, f"every stage is named: FROM {rest}"
            out.append(Stage(name=m.group(2), base=m.group(1)))
        elif out:
            out[-1].instructions.append((word, rest))
    return out


def stage(name: str) -> Stage:
    return next(s for s in stages() if s.name == name)


def build_args() -> dict[str, str]:
    """Every `ARG NAME=default` of the file."""
    return dict(rest.split("=", 1) for word, rest in instructions() if word == "ARG" and "=" in rest)


def dockerignore_patterns() -> list[str]:
    return [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's `patterns` leave `rel` (a path in the repository) out of the context."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        hit = any(
            fnmatch.fnmatch(p, pat) or (pat.startswith("**/") and fnmatch.fnmatch(p.split("/")[-1], pat[3:]))
            for p in prefixes
        )
        if hit:
            result = not neg
    return result


def copy_from_context(sources: list[str], dest: Path, *, keep_path: bool = True) -> None:
    """What `COPY sources...` copies from the build context (after .dockerignore) into `dest`.

    With `keep_path` a source lands at its repository path below `dest` (``COPY producer
    /src/producer``); without, a file lands in `dest` itself (``COPY pyproject.toml ./``).
    """
    patterns = dockerignore_patterns()
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"COPY {src}: not in the repository"
        assert not ignored(src, patterns), f"COPY {src}: excluded by .dockerignore"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if ignored(rel, patterns):
                continue
            target = dest / (rel if keep_path else f.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)


def project_files() -> list[str]:
    """The files the `base` stage copies into its WORKDIR (the project's metadata)."""
    (copy,) = stage("base").copies()
    return copy[:-1]


def source_folders() -> list[str]:
    """The folders the `src` stage copies (each to /src/FOLDER)."""
    out = []
    for words in stage("src").copies():
        src, dest = words
        assert dest == f"/src/{src}", words
        out.append(src)
    return out


def run_stage(name: str, workdir: Path, env: dict[str, str], timeout: float) -> None:
    """Run stage `name`'s RUN lines with `sh -c` in `workdir`, and its ``COPY --from=src /src ./``
    as a copy of the source folders: the Dockerfile's install sequence, outside Docker."""
    for word, rest in stage(name).instructions:
        if word == "COPY":
            assert rest.split() == ["--from=src", "/src", "./"], rest
            copy_from_context(source_folders(), workdir)
        elif word == "RUN":
            r = subprocess.run(
                ["sh", "-c", rest], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout
            )
            assert r.returncode == 0, f"RUN {rest}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def venv_env(venv: Path) -> dict[str, str]:
    """The environment of a shell with `venv` activated (its pip, python and scripts first on PATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env
