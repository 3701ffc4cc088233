"""`rlrec inspect` and `rlrec report` as printed for a person: styles as Rich Text (never markup
on the markup-free console), whole numbers at 80 columns in one format (``12,345``), a caption
that names the right flag, a store with claims but no shard saying when the first one is due,
and `report` counting the shards `inspect` counts."""

from __future__ import annotations

import re

import pytest

from rlrec.cli import build_parser, main
from rlrec.store.commit import ShardCommitter
from rlrec.store.manifest import PartitionLog
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes

LONG_POLICY = "a-rather-long-policy-name-for-the-tests"


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Two shards with Kafka offsets past a billion, no propensities, a long policy id."""
    root = str(tmp_path_factory.mktemp("big"))
    c = ShardCommitter(root, "rl", 0)
    base = 1_234_567_890
    for k in range(2):
        eps = expert_cartpole_episodes(12, seed=k, policy_id=LONG_POLICY, with_logp=False)
        for i, e in enumerate(eps):
            e.first_offset = base + 1000 * (12 * k + i)
            e.last_offset = e.first_offset + 999
        c.commit(eps)
    return root, base


def test_inspect_at_80_columns_keeps_numbers_whole_in_one_format(big, capsys, monkeypatch):
    root, base = big
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["inspect", root]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert f"{base}-{base + 11_999}" in out, out  # the first shard's offsets (positions, as Kafka prints them), whole
    rows = [
        line for line in out.splitlines() if str(base)[:5] in line
    ]  # the shard rows (a narrow policy column may go)
    assert len(rows) == 2 and all(re.search(r"\d\d-\d\d \d\d:\d\d:\d\d\s*$", r) for r in rows), rows
    assert "[yellow]" not in out and "[/" not in out, out  # no markup printed literally
    assert "file paths: --paths" in out
    # one number format: thousands separators in every table (the totals' steps, over 1,000)
    from rlrec.store.maintenance import inspect

    steps = inspect(Storage.from_uri(root))["totals"]["steps"]
    assert steps >= 1000 and out.count(f"{steps:,}") >= 2, out  # totals and the propensity table


def test_inspect_on_claims_without_shards_says_when_the_first_is_due(tmp_path, capsys):
    storage = Storage.from_uri(str(tmp_path))
    for p in range(2):
        PartitionLog(storage, "rl", p).claim("consumer-1")
    assert main(["inspect", str(tmp_path), "--verify"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no shard committed yet: 2 partition(s) claimed" in out, out
    assert "--max-file-age-s (60 s by default)" in out
    assert "verify: no problems" not in out and "nothing to verify" in out


def test_report_counts_the_shards_inspect_counts_after_a_compaction(tmp_path):
    from rlrec.report import summary
    from rlrec.report_data import collect
    from rlrec.store.compaction import compact_unowned
    from rlrec.store.maintenance import inspect

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    for k in range(4):
        c.commit(expert_cartpole_episodes(2, seed=k, max_steps=30))
    storage = Storage.from_uri(root)
    results, refused = compact_unowned(storage, min_age_s=0, force=True)
    assert refused == [] and results[0].replaced == 4
    live = inspect(storage)["totals"]["shards"]
    assert live == 1
    rows = dict(summary(collect(input_uri=root)))
    assert rows["shards"] == f"{live:,}"


def test_report_takes_a_public_key():
    args = build_parser().parse_args(["report", "--public-key", "trainer.pub"])
    assert args.public_key == "trainer.pub"
