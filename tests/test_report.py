"""`rlrec report`: HTML with every section's plot and the summary numbers, from real shards."""

from __future__ import annotations

import base64
import json
import re
import time

import pytest

from rlrec.cli import main
from rlrec.report import SECTIONS, freshness, write_report
from rlrec.report_data import collect
from rlrec.store.commit import ShardCommitter
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes

DEAD = {"bad-schema": 3, "oversized": 1}


def _demo_dir(tmp_path, *, trainer: bool = True, demo_metrics: bool = True):
    """A demo data dir (layout.md): real committed shards of 3 policy versions, trainer and demo metrics."""
    d = tmp_path / "demo-data"
    shards = d / "shards"
    t0 = time.time() - 100
    committer = ShardCommitter(str(shards))
    entries = []
    for v in (1, 2, 3):
        eps = expert_cartpole_episodes(4, seed=v, policy_id="cartpole", policy_version=v, epsilon=0.1 * v, max_steps=60)
        for i, e in enumerate(eps):
            e.started_ms = int((t0 + 10 * v + i) * 1000)
            e.ended_ms = e.started_ms + 500
        entries += committer.commit(eps).entries
    assert len(entries) == 3
    (d / "demo.json").write_text(
        json.dumps(
            {
                "started": t0,
                "ended": t0 + 90,
                "args": {},
                "shards_uri": str(shards),
                "trainer_dir": str(d / "trainer"),
                "s3_endpoint": None,
                "topic": "rl",
                "dlq_topic": "rl.dlq",
                "policies": 2,
            }
        )
    )
    if trainer:
        (d / "trainer").mkdir()
        lines = []
        for it, e in enumerate(entries, 1):
            t = e.commit_time + 1.5
            lines.append(
                {
                    "iteration": it,
                    "policy_version": it,
                    "timesteps_trained": 1000 * it,
                    "time": t,
                    "eval_return_mean": 100.0 * it,
                    "new_shards": [e.path],
                    "promotion": {
                        "candidate_version": it + 1,
                        "candidate_return": 100.0 * it,
                        "deployed_version": it,
                        "deployed_return": 90.0 * it,
                        "promoted": it != 2,
                    },
                }
            )
        (d / "trainer" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if demo_metrics:
        (d / "metrics.jsonl").write_text(
            json.dumps({"time": t0 + 5, "dead_letters": {"bad-schema": 1}})
            + "\n"
            + json.dumps({"time": t0 + 80, "dead_letters": DEAD})
            + "\n"
        )
    return d, entries


def _images(html: str) -> dict[str, bytes]:
    return {
        m.group(1): base64.b64decode(m.group(2))
        for m in re.finditer(r'<img id="plot-([a-z-]+)"[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    }


def _summary(html: str) -> dict[str, str]:
    return dict(re.findall(r"<tr><th>([^<]+)</th><td class=\"v\">([^<]*)</td></tr>", html))


def test_report_has_every_section_and_the_summary(tmp_path):
    d, entries = _demo_dir(tmp_path)
    rc = main(["report", str(d)])
    assert rc == 0
    html = (d / "report.html").read_text()
    imgs = _images(html)
    assert set(imgs) == {sid for sid, _ in SECTIONS}
    assert all(b.startswith(b"\x89PNG") and len(b) > 2000 for b in imgs.values())
    assert "http://" not in html and "https://" not in html  # self-contained
    s = _summary(html)
    assert s["episodes"] == "12" and s["shards"] == "3"
    assert s["steps"] == f"{sum(e.steps for e in entries):,}"
    assert s["policy versions"] == "3 (1–3)"
    assert s["dead letters"] == "4"
    assert s["trainer iterations"] == "3"
    assert s["evaluation return (last / best)"] == "300.0 / 300.0"
    assert "time span" in s


def test_freshness_maps_new_shards_to_manifest_entries(tmp_path):
    d, _entries = _demo_dir(tmp_path)
    data = collect(d)
    assert data.first_trained.keys() == {e.path for e in read_manifest(Storage.from_uri(str(d / "shards")))}
    f = freshness(data)
    assert f["shard commit → first trained on"] == pytest.approx([1.5, 1.5, 1.5])
    assert len(f["episode end → shard commit"]) == 12 and all(x > 0 for x in f["episode end → shard commit"])
    assert len(f["episode end → first trained on"]) == 12
    assert data.dead_letters == DEAD


def test_report_degrades_with_notes(tmp_path):
    d, _ = _demo_dir(tmp_path, trainer=False, demo_metrics=False)
    out = tmp_path / "r" / "x.html"
    path = write_report(d, out)
    assert path == out
    html = out.read_text()
    imgs = _images(html)
    assert "returns" in imgs and "shards" in imgs and "freshness" in imgs  # shards alone give these
    assert "eval" not in imgs and "dead-letters" not in imgs
    assert "no evaluation results yet" in html
    assert "trainer/metrics.jsonl does not exist yet" in html
    assert "no dead-letter counts" in html
    assert _summary(html)["episodes"] == "12"

    # an empty directory: every section is a note, still a valid report
    empty = tmp_path / "empty"
    empty.mkdir()
    html = write_report(None, tmp_path / "e.html", input_uri=str(empty)).read_text()
    assert _images(html) == {}
    assert "no committed shards" in html and _summary(html)["episodes"] == "0"


def test_report_cli_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_report_and_convert_on_object_stores(tmp_path, object_store, monkeypatch, capsys):
    """Shards on S3, GCS, Azure: `rlrec convert --output URI` then `rlrec report --input URI`."""
    import pyarrow.parquet as pq

    from rlrec.store.shards import tabular_table

    uri = object_store.output(monkeypatch, "shards")
    eps = expert_cartpole_episodes(5, seed=4, max_steps=30, policy_id="legacy", policy_version=2)
    (tmp_path / "in").mkdir()
    pq.write_table(tabular_table(eps), tmp_path / "in" / "x.parquet")
    assert main(["convert", "--from", "tabular", str(tmp_path / "in"), "--output", uri, "--policy-id", "legacy"]) == 0
    assert main(["inspect", uri, "--verify"]) == 0
    out = tmp_path / "report.html"
    assert main(["report", "--input", uri, "--out", str(out)]) == 0
    html = out.read_text()
    assert {"returns", "shards"} <= set(_images(html))
    s = _summary(html)
    assert (s["episodes"], s["shards"], s["policies"], s["policy versions"]) == ("5", "1", "legacy", "1 (2)")
    assert "no trainer checkpoint dir given" in html


@pytest.mark.broker
def test_dead_letters_from_the_dlq_topic(tmp_path, broker, topic):
    """With --bootstrap-servers the dead letters are counted from the DLQ's reason headers."""
    from confluent_kafka import Producer

    from rlrec.consumer.topics import dlq_topic_name

    dlq = dlq_topic_name(topic)
    p = Producer({"bootstrap.servers": broker.bootstrap_servers})
    for i, reason in enumerate(["bad-schema"] * 3 + ["oversized", None]):
        headers = [("rlrec-dlq-reason", reason.encode())] if reason else []
        p.produce(dlq, b"x", key=str(i).encode(), partition=i % 4, headers=headers)
    assert p.flush(10) == 0
    d, _ = _demo_dir(tmp_path, trainer=False)  # its metrics.jsonl says DEAD; the topic wins
    out = tmp_path / "r.html"
    assert (
        main(["report", str(d), "--out", str(out), "--bootstrap-servers", broker.bootstrap_servers, "--dlq-topic", dlq])
        == 0
    )
    data = collect(d, bootstrap_servers=broker.bootstrap_servers, dlq_topic=dlq)
    assert data.dead_letters == {"bad-schema": 3, "oversized": 1, "unknown": 1}
    html = out.read_text()
    assert "dead-letters" in _images(html) and _summary(html)["dead letters"] == "5"


def _ope_lines(t: float) -> list[dict]:
    est = {"value": 41.0, "ci_low": 37.5, "ci_high": 44.0, "estimable": True, "reason": ""}
    none = {"value": None, "ci_low": None, "ci_high": None, "estimable": False, "reason": "support: 0.4"}
    return [
        {
            "iteration": 4,
            "time": t,
            "policy_version": 3,
            "ope_report": {"candidate_version": 4, "estimator": "wdr", "candidate_estimate": est, "true_return": 43.25},
        },
        {
            "iteration": 5,
            "time": t + 1,
            "policy_version": 3,
            "ope_report": {
                "candidate_version": 5,
                "estimator": "wdr",
                "candidate_estimate": none,
                "reason": "support: 0.4",
                "true_return": 12.0,
            },
        },
        {
            "iteration": 6,
            "time": t + 2,
            "policy_version": 3,
            "promotion": {
                "gate": "ope",
                "candidate_version": 6,
                "estimator": "wdr",
                "candidate_estimate": est,
                "promoted": False,
            },
        },
    ]


def test_report_shows_ope_estimates_beside_the_true_discounted_return(tmp_path):
    from rlrec.report import ope_rows

    d, entries = _demo_dir(tmp_path)
    with open(d / "trainer" / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(x) + "\n" for x in _ope_lines(entries[-1].commit_time + 5))
    rows = ope_rows(collect(d))
    assert [(r["version"], r["estimate"], r["true_return"], r["promoted"]) for r in rows] == [
        (4, 41.0, 43.25, None),
        (5, None, 12.0, None),
        (6, 41.0, None, False),
    ]
    assert rows[1]["reason"] == "support: 0.4"
    assert main(["report", str(d)]) == 0
    html = (d / "report.html").read_text()
    assert "eval" in _images(html)
    table = html[html.index('<table id="ope-table">') :]
    table = table[: table.index("</table>")]
    assert table.count("<tr>") == 4  # a header and one row per evaluation
    assert "<td>v4</td>" in table and "[37.50, 44.00]" in table and "43.25" in table and "(report only)" in table
    assert "rejected" in table and "support: 0.4" in table


def test_dashboard_shows_the_newest_ope_estimate_beside_the_truth(tmp_path):
    from rlrec.demo.dashboard import Collector, compact_line

    path = tmp_path / "metrics.jsonl"
    lines = _ope_lines(time.time())
    path.write_text(json.dumps({"iteration": 3, "time": time.time(), "policy_version": 3}) + "\n")
    c = Collector([], None, str(path))
    s = c.snapshot()
    assert s.ope is None and " ope " not in compact_line(s)
    with open(path, "a") as f:
        f.write(json.dumps(lines[0]) + "\n")
    s = c.snapshot()
    assert s.ope["version"] == 4 and s.ope["value"] == 41.0 and s.ope["true_return"] == 43.25
    assert compact_line(s).endswith("ope v4 wdr 41.0 [37.5, 44.0]  true 43.2")
    assert s.to_record()["ope"]["version"] == 4  # in demo-data/metrics.jsonl too
    with open(path, "a") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines[1:])
    s = c.snapshot()
    assert s.ope["version"] == 6 and s.ope["true_return"] is None  # the newest: the gate's decision
    with open(path, "a") as f:
        f.write(json.dumps(lines[1]) + "\n")
    assert "v5 wdr not estimable (support: 0.4)  true 12.0" in compact_line(c.snapshot())


def test_the_demo_line_prints_counts_in_the_one_number_format():
    """The dashboard's line (no terminal) separates thousands as its live view and the demo's summary do."""
    import time

    from rlrec.demo.dashboard import Snapshot, compact_line

    s = Snapshot(
        time=time.time(),
        elapsed_s=97,
        steps_published=208957,
        steps_per_s=2375.4,
        episodes_committed=1588,
        shards_committed=1113,
        dead_letters={"decode-error": 1200},
        trainer_iteration=5,
        timesteps_trained=56320,
    )
    line = compact_line(s)
    for text in ("steps 208,957 (2,375/s)", "episodes 1,588", "shards 1,113", "dead letters 1,200", "trained 56,320"):
        assert text in line, line
