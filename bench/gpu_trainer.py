"""The trainer's GPU path end to end, on a machine with CUDA: ``rlrec train --num-gpus-per-learner 1``.

    python bench/gpu_trainer.py [--iterations 40] [--shards 16] [--num-cpus 8] [--num-learners N] \\
        [--no-cpu-side] --json PATH

What it does, as a user would: commits scripted-expert CartPole shards to a local store, runs
``rlrec train --algo BC --env CartPole-v1 --num-gpus-per-learner 1`` (a fresh interpreter, the
Learner in the driver) for ``--iterations`` iterations with an evaluation every 5, then the same
command with ``--num-gpus-per-learner 0`` (same data, batch size, iterations and CPUs), and loads
each published policy with ``load_policy`` on the CPU to play 10 greedy CartPole episodes.
``--num-learners N`` runs N Learner actors (Ray schedules each on a GPU) instead of the Learner in
the driver; ``--no-cpu-side`` skips the CPU run. While the GPU side runs, ``nvidia-smi`` is
sampled every 0.5 s: the trainer's process must hold GPU memory (else the "GPU" run trained on the CPU and the check fails; where the sandbox hides
the pid, the device's memory in use must rise by over 100 MiB during the run).

Reported per side: exit code, wall seconds, iterations, median iteration seconds after the
first two (start-up excluded), rows trained per second over those iterations, the last loss,
the best evaluation return, the greedy return of the published policy on the CPU, and for the
GPU side the trainer's peak GPU memory as nvidia-smi saw it. One round each, GPU first: an
observation of one machine, not a benchmark ratio (CartPole's 2x256 MLP is far too small for a
GPU to pay off; the point is that the path runs and trains as well).

Exit code 0 when every check holds (both runs exit 0 at their last iteration, the GPU run used
the GPU, both policies reach a greedy return of 400), 1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _nvidia_smi(*query: str) -> str:
    """nvidia-smi's CSV answer (no header, no units) to `query`; "" when it cannot answer."""
    try:
        return subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _gpu_memory_by_pid() -> dict[int, int]:
    """``{pid: used MiB}`` of the GPU's compute processes, {} when nvidia-smi cannot say."""
    got = {}
    for line in _nvidia_smi("--query-compute-apps=pid,used_memory").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            got[int(parts[0])] = int(parts[1])
    return got


def _total_gpu_memory_used() -> int | None:
    """MiB in use on the first GPU, None when nvidia-smi cannot say."""
    first = _nvidia_smi("--query-gpu=memory.used").split()
    return int(first[0]) if first and first[0].isdigit() else None


def _greedy_return(ck: str, episodes: int = 10) -> float:
    import gymnasium as gym

    from rlrec.trainer.policy import load_policy

    policy = load_policy(ck, allow_unsigned=True)  # the bench's own run, unsigned
    env = gym.make("CartPole-v1")
    total = 0.0
    for seed in range(episodes):
        obs, _ = env.reset(seed=10_000 + seed)
        done = False
        while not done:
            action, _ = policy.act(obs)
            obs, reward, terminated, truncated, _ = env.step(int(action))
            total += float(reward)
            done = terminated or truncated
    return total / episodes


def _run_side(store: str, work: Path, gpus: int, args: argparse.Namespace) -> dict:
    ck = str(work / f"ck-gpu{gpus}")
    cmd = [
        sys.executable,
        "-m",
        "rlrec",
        "train",
        "--input",
        store,
        "--algo",
        "BC",
        "--env",
        "CartPole-v1",
        "--promotion-gate",
        "off",
        "--checkpoint-dir",
        ck,
        "--eval-interval",
        "5",
        "--eval-episodes",
        "3",
        "--max-iterations",
        str(args.iterations),
        "--checkpoint-interval",
        "1000",
        "--algo-config",
        "lr=0.001",
        "--algo-config",
        f"train_batch_size_per_learner={args.batch_size}",
        "--num-cpus",
        str(args.num_cpus),
        "--num-gpus-per-learner",
        str(gpus),
        "--num-learners",
        str(args.num_learners),
    ]
    samples: list[tuple[float, dict[int, int], int | None]] = []
    baseline = _total_gpu_memory_used() if gpus else None
    stop = threading.Event()
    t0 = time.time()
    log = open(work / f"train-gpu{gpus}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time() - t0, _gpu_memory_by_pid(), _total_gpu_memory_used()))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    if gpus:
        sampler.start()
    try:
        rc = proc.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    stop.set()
    log.close()
    wall = time.time() - t0
    lines = (
        [json.loads(x) for x in open(os.path.join(ck, "metrics.jsonl"))]
        if os.path.exists(os.path.join(ck, "metrics.jsonl"))
        else []
    )
    steady = lines[2:]
    iter_s = [r["iteration_s"] for r in steady if r.get("iteration_s")]
    rows = sum(r.get("rows_trained") or 0 for r in steady)
    out = {
        "num_gpus_per_learner": gpus,
        "rc": rc,
        "wall_s": round(wall, 1),
        "iterations": len(lines),
        "median_iteration_s": round(statistics.median(iter_s), 3) if iter_s else None,
        "rows_trained_per_s": round(rows / sum(iter_s), 1) if iter_s else None,
        "last_loss": lines[-1].get("learner_loss") if lines else None,
        "best_eval_return": max((r.get("eval_return_mean") or 0 for r in lines), default=None),
        "log_tail": (work / f"train-gpu{gpus}.log").read_text(errors="replace")[-3000:],
    }
    if gpus:
        mine = [s[1].get(proc.pid, 0) for s in samples]
        out["gpu_memory_mib_peak_trainer"] = max(mine, default=0)
        out["gpu_memory_mib_peak_device"] = max((s[2] or 0 for s in samples), default=None)
        out["gpu_memory_mib_before"] = baseline
        out["gpu_samples"] = len(samples)
    try:
        out["greedy_return_cpu_load"] = _greedy_return(ck)
    except Exception as e:  # reported, and the checks below fail
        out["greedy_return_cpu_load"] = None
        out["load_error"] = f"{type(e).__name__}: {e}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--num-cpus", type=int, default=8)
    ap.add_argument("--num-learners", type=int, default=0, help="0: the Learner in the driver; N: N Learner actors")
    ap.add_argument("--cpu-side", action=argparse.BooleanOptionalAction, default=True, help="also run the CPU side")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per side")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_trainer: error: no CUDA device", file=sys.stderr)
        return 2
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    work = Path(tempfile.mkdtemp(prefix="rlrec-gpu-"))
    store = str(work / "store")
    c = ShardCommitter(store)
    for i in range(args.shards):
        c.commit(expert_cartpole_episodes(4, seed=i, epsilon=0.05))
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "shards": args.shards,
        "batch_size": args.batch_size,
        "num_cpus": args.num_cpus,
        "num_learners": args.num_learners,
        "sides": [],
    }
    for gpus in (1, 0) if args.cpu_side else (1,):
        side = _run_side(store, work, gpus, args)
        result["sides"].append(side)
        print(json.dumps({k: v for k, v in side.items() if k != "log_tail"}), flush=True)
    gpu, cpu = result["sides"][0], result["sides"][-1]
    checks = {
        "both runs exit 0": gpu["rc"] == 0 and cpu["rc"] == 0,
        "both ran every iteration": gpu["iterations"] == cpu["iterations"] == args.iterations,
        # by its pid, or (a sandbox that hides pids from nvidia-smi) the device's use during the run
        "the GPU run's trainer held GPU memory": (gpu.get("gpu_memory_mib_peak_trainer") or 0) > 0
        or (gpu.get("gpu_memory_mib_peak_device") or 0) - (gpu.get("gpu_memory_mib_before") or 0) > 100,
        "both policies reach a greedy return of 400 on the CPU": all(
            (s["greedy_return_cpu_load"] or 0) >= 400 for s in (gpu, cpu)
        ),
    }
    result["checks"] = checks
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
