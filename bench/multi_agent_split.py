"""CPU per agent step of the two multi-agent builders, on the same simple_spread recordings.

    python bench/multi_agent_split.py [--episodes E] [--rounds R] [--json PATH]

The recordings: E episodes of PettingZoo simple_spread (mpe2, 3 agents, 25 cycles, random
actions, one ``action_logp`` per acting agent), stepped once before timing. Each round builds
every episode's `MultiAgentSplit` (the agents' `SingleAgentEpisode`s plus the multi-agent
record) two ways, alternating which goes first, and each way also with the row bytes the shard
writer packs (``item`` per agent and the record):

* ``fast``: `split_recording` (direct: one `SingleAgentEpisode` constructor per agent);
* ``replay``: `reference_episode` (RLlib's `add_env_reset`/`add_env_step`) then `split_episode`
  -- the same result (tests/test_multi_agent_split.py);
* ``fast+pack`` / ``replay+pack``: the same, then `pack_episode` of each row and `pack_record`.

Figures: process CPU µs per agent step (agent steps = the rows' lengths summed), median over
the rounds after one warm-up with min-max, and the replay/fast ratio per round (median, min-max).
Needs ``pip install "pettingzoo==1.27.*" "mpe2==1.1.*"``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rlrec.consumer.multi_agent_reference import reference_episode
from rlrec.consumer.multi_agent_split import split_episode, split_recording
from rlrec.store.episodes import pack_episode
from rlrec.store.multi_agent_episode import pack_record
from tests.multi_agent_cases import simple_spread


def _fast(recs, pack):
    for rec in recs:
        s = split_recording(rec)
        if pack:
            [pack_episode(e) for e in s.rows.values()]
            pack_record(s.record)


def _replay(recs, pack):
    for rec in recs:
        s = split_episode(reference_episode(rec), rec)
        if pack:
            [pack_episode(e) for e in s.rows.values()]
            pack_record(s.record)


WAYS = {
    "fast": lambda r: _fast(r, False),
    "replay": lambda r: _replay(r, False),
    "fast+pack": lambda r: _fast(r, True),
    "replay+pack": lambda r: _replay(r, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    recs = [simple_spread(f"spread-{i}", seed=i) for i in range(a.episodes)]
    agent_steps = sum(len(e) for r in recs for e in split_recording(r).rows.values())
    names = list(WAYS)
    per: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(a.rounds + 1):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for n in order:
            t0 = time.process_time()
            WAYS[n](recs)
            us = (time.process_time() - t0) * 1e6 / agent_steps
            if rnd:  # round 0 warms up
                per[n].append(us)
    out = {"agent_steps_per_round": agent_steps, "episodes": a.episodes, "rounds": a.rounds}
    for n in names:
        out[n] = {
            "median_us": statistics.median(per[n]),
            "min_us": min(per[n]),
            "max_us": max(per[n]),
            "rounds": per[n],
        }
    for base, other in (("fast", "replay"), ("fast+pack", "replay+pack")):
        ratios = [o / b for b, o in zip(per[base], per[other])]
        out[f"{other}/{base}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"{k:>22}: " + "  ".join(f"{m}={x:.2f}" for m, x in v.items() if m != "rounds"))
        else:
            print(f"{k:>22}: {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
