"""The README is executable: every ```bash and ```python block in README.md, and in the docs
pages that parts of it moved to (`PAGES`), runs here.

A block runs as written, or with the substitutions it declares in an HTML comment on the
line(s) just before it, or not at all with a visible reason::

    <!-- readme-test: substitute kafka:9092=<broker> -->
    <!-- readme-test: substitute demo-data/shards=<shards> -->
    <!-- readme-test: not run here: needs docker compose -->

Substitution values in angle brackets are made by the harness: ``<broker>`` the embedded
broker's address (the ``broker`` fixture), ``<shards>`` a consumer output with committed
CartPole episodes, ``<policies>`` a policies folder with one signed CartPole BC policy and
``<public_key>`` its public key, ``<tmp>`` an empty folder. Any other value is used as written. Python blocks
run with this interpreter, bash blocks with ``bash -e`` and this interpreter's folder first on
PATH (where ``rlrec`` is), each in a fresh folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: README.md and the docs pages that parts of it moved to: their blocks run here too
PAGES = (README, ROOT / "docs" / "API.md", ROOT / "docs" / "BENCHMARKS.md", ROOT / "docs" / "READING.md")
#: the README is a first page: what a newcomer needs, the rest in docs/ pages it links to
README_MAX_LINES = 300
DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
RUN_LANGS = ("bash", "python")
#: seconds one block may take (the quick start takes about 4 minutes on 2 busy cores)
BLOCK_TIMEOUT_S = 540


@dataclass
class Block:
    """One fenced block of README.md and what its directives say."""

    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    substitutions: dict[str, str] = field(default_factory=dict)
    not_run: str | None = None  # the reason, when it does not run here
    page: str = "README.md"  # the file it is in, relative to the repository

    @property
    def id(self) -> str:
        prefix = "" if self.page == "README.md" else self.page.replace("/", "-").removesuffix(".md") + "-"
        return f"{prefix}{self.lang}-line{self.line}"

    def tokens(self) -> set[str]:
        return {v for v in self.substitutions.values() if re.fullmatch(r"<\w+>", v)}


def parse_blocks(text: str) -> list[Block]:
    """The fenced blocks of `text` with the ``readme-test`` directives just above each.

    Args:
        text: Markdown.

    Raises:
        ValueError: a directive that is neither ``substitute OLD=NEW`` nor ``not run here: REASON``.

    Example:
        >>> b = parse_blocks("<!-- readme-test: substitute a=<tmp> -->\\n```bash\\necho a\\n```\\n")
        >>> (b[0].lang, b[0].code, b[0].substitutions)
        ('bash', 'echo a\\n', {'a': '<tmp>'})
    """
    blocks: list[Block] = []
    pending: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = DIRECTIVE.match(lines[i])
        if m:
            pending.append(m.group(1))
            i += 1
            continue
        fence = FENCE.match(lines[i])
        if fence:
            start = i
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            block = Block(fence.group(1), "\n".join(body) + "\n", start + 1)
            for d in pending:
                if d.startswith("substitute "):
                    old, sep, new = d[len("substitute ") :].partition("=")
                    if not sep or not old:
                        raise ValueError(f"README.md:{start + 1}: expected substitute OLD=NEW, got {d!r}")
                    block.substitutions[old] = new
                elif d.startswith("not run here:") and d[len("not run here:") :].strip():
                    block.not_run = d[len("not run here:") :].strip()
                else:
                    raise ValueError(f"README.md:{start + 1}: unknown readme-test directive {d!r}")
            blocks.append(block)
            pending = []
        elif lines[i].strip():
            pending = []  # a directive applies to the block right after it (blank lines allowed)
        i += 1
    return blocks


def _page_blocks(path: Path) -> list[Block]:
    page = str(path.relative_to(ROOT))
    return [Block(b.lang, b.code, b.line, b.substitutions, b.not_run, page) for b in parse_blocks(path.read_text())]


BLOCKS = [b for path in PAGES for b in _page_blocks(path) if b.lang in RUN_LANGS]


def test_every_block_runs_or_says_why_not():
    """Each shell and Python block is run below, or carries a not-run reason; substitutions
    name text that is in the block."""
    assert BLOCKS, "no ```bash or ```python blocks found in README.md"
    for b in BLOCKS:
        for old in b.substitutions:
            assert old in b.code, f"{b.page}:{b.line}: substitute {old!r}: not in the block"
    not_run = [f"{b.page}:{b.line} ({b.lang}): {b.not_run}" for b in BLOCKS if b.not_run]
    print("not run here:\n  " + "\n  ".join(not_run))
    assert any(b.not_run is None and b.lang == "python" for b in BLOCKS)


def test_readme_stays_a_first_page():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move details into a docs/ page and link it"
    )


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_of_the_pages_point_at_files_and_headings_that_exist():
    """Every relative link of README.md and its pages names an existing file, and an anchor
    (``page.md#heading``) names one of that page's headings, so a move leaves no dead link."""
    dead = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                dead.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.S), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    dead.append(f"{page.name}: {target} (no such heading)")
    assert not dead, "dead links:\n  " + "\n  ".join(dead)


def _marks(b: Block) -> list:
    marks = [pytest.mark.slow, pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)]
    if "<broker>" in b.tokens():
        marks.append(pytest.mark.broker)
    if "ray" in b.code:
        marks.append(pytest.mark.system)
    if re.search(r"\brlrec (train|evaluate)\b", b.code):  # starts Ray: one at a time (tests/conftest.py)
        marks.append(pytest.mark.xdist_group("ray"))
    if b.not_run:
        marks.append(pytest.mark.skip(reason=f"{b.page}:{b.line}: not run here: {b.not_run}"))
    return marks


def _policies(root: Path, trained_on: str | None = None) -> tuple[str, str]:
    """(policies folder, public key): one signed BC policy for CartPole, as `rlrec train` publishes;
    its lineage names every shard of the store `trained_on` (and the cursor holding them), if given."""
    import gymnasium as gym
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rlrec.store.storage import Storage
    from rlrec.trainer.export import build_artifact, publish_policy
    from rlrec.trainer.service import ALGORITHMS, _import
    from rlrec.trainer.signing import generate_keys, load_private_key

    env = gym.make("CartPole-v1")
    obs_space, act_space = env.observation_space, env.action_space
    config = _import(ALGORITHMS["BC"][0])().environment(observation_space=obs_space, action_space=act_space)
    module = config.get_multi_rl_module_spec(spaces={DEFAULT_MODULE_ID: (obs_space, act_space)}).build()
    priv, pub = generate_keys(root / "keys")
    shards, data = [], None
    if trained_on is not None:
        from rlrec.store.snapshot import cursor_covering, open_snapshot

        entries = open_snapshot(trained_on).entries
        shards = [e.path for e in entries]
        cursor = str(cursor_covering(trained_on, entries))
        data = {"input": Storage.from_uri(trained_on).uri(), "cursor": cursor, "holdout_fraction": 0.1}
    publish_policy(
        Storage.from_uri(str(root / "policies")),
        algo=None,
        version=1,
        algo_name="BC",
        observation_space=obs_space,
        action_space=act_space,
        iteration=1,
        timesteps_trained=0,
        shards=shards,
        new_shards=shards,
        data=data,
        parent_version=None,
        signing_key=load_private_key(priv),
        artifact=build_artifact(module[DEFAULT_MODULE_ID].eval(), obs_space, act_space),
    )
    return str(root / "policies"), str(pub)


def _shards(root: Path) -> str:
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    out = root / "shards"
    ShardCommitter(str(out)).commit(expert_cartpole_episodes(20, seed=1, max_steps=200, policy_id="cartpole-expert"))
    return str(out)


def _run_block(cmd: list[str], code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a block in its own process group; past `BLOCK_TIMEOUT_S` the whole group is killed, so
    nothing it started in the background (the quick start's ``rlrec broker &``) outlives it."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, text=True, start_new_session=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = proc.communicate(code, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {BLOCK_TIMEOUT_S} s:\n{code}\n{out}\n{err}")
    finally:
        if proc.poll() is None:  # the test was interrupted (pytest-timeout, Ctrl-C)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_a_block_past_its_time_leaves_nothing_running(tmp_path, monkeypatch):
    """A block that outlives `BLOCK_TIMEOUT_S` fails, and what it started in the background is
    killed with it (a quick start's broker once kept port 9092 after its test timed out)."""
    monkeypatch.setattr(sys.modules[__name__], "BLOCK_TIMEOUT_S", 2)
    pid_file = tmp_path / "pid"
    code = f"sleep 600 & echo $! > {pid_file}\nwait\n"
    with pytest.raises(pytest.fail.Exception, match="timed out after 2 s"):
        _run_block(["bash", "-e", "-s"], code, tmp_path, dict(os.environ))
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), f"the block's background process {pid} outlived it"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=_marks(b)) for b in BLOCKS])
def test_readme_block(block: Block, request: pytest.FixtureRequest, tmp_path: Path):
    made: dict[str, str] = {}
    for token in block.tokens():
        if token == "<broker>":
            made[token] = request.getfixturevalue("broker").bootstrap_servers
        elif token == "<shards>":
            if token not in made:
                made[token] = _shards(tmp_path / "data")
        elif token in ("<policies>", "<public_key>"):
            if "<policies>" not in made:
                trained_on = None  # a block that reads shards too: the policy was trained on them
                if "<shards>" in block.tokens():
                    made.setdefault("<shards>", _shards(tmp_path / "data"))
                    trained_on = made["<shards>"]
                made["<policies>"], made["<public_key>"] = _policies(tmp_path / "trained", trained_on)
        elif token == "<tmp>":
            (tmp_path / "tmp").mkdir()
            made[token] = str(tmp_path / "tmp")
        else:
            pytest.fail(f"{block.page}:{block.line}: unknown substitution value {token}")
    code = block.code
    for old, new in block.substitutions.items():
        code = code.replace(old, made.get(new, new))
    work = tmp_path / "work"
    work.mkdir()
    bindir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREC_") or k.startswith("RLREC_TEST_")}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    cmd = [sys.executable, "-"] if block.lang == "python" else ["bash", "-e", "-s"]
    p = _run_block(cmd, code, work, env)
    assert p.returncode == 0, f"{block.page}:{block.line} failed (exit {p.returncode}):\n{code}\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr, f"{block.page}:{block.line} printed a traceback:\n{p.stderr}"
