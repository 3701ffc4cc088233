"""docker-compose.yml's services, run as local processes: the closed loop the compose way.

There is no Docker engine here, so this runs each service's command and environment exactly as
the compose file writes them, with the two host names swapped for the embedded stack:
`kafka:9092` -> a Tansu broker, `http://minio:9000` -> a moto S3 server (MinIO itself can't be
installed here); `minio-init`'s `mc mb` is done with boto3 and the metrics server binds
127.0.0.1. It checks what the static tests in test_compose.py cannot: that the services, wired
only through RLREC_* / AWS_* variables and S3 URIs, close the loop — policies publish, the
consumer commits shards to S3, the trainer trains on them, checkpoints to S3 and publishes a
policy the policy processes load from S3 and act with.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlrec.local import LocalBroker, LocalS3, free_port
from tests.compose_model import ROOT, command_list, created_buckets, env_of, load_compose

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.broker, pytest.mark.timeout(600)]

LOOP_TIMEOUT_S = 420


class Service:
    """One compose service (one replica) as a child process with its log in a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self._f = open(log, "wb")
        self.proc = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=self._f, stderr=subprocess.STDOUT, start_new_session=True
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._f.close()
        return self.proc.returncode


def _swap(value: str, swaps: dict[str, str]) -> str:
    for a, b in swaps.items():
        value = value.replace(a, b)
    return value


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RLREC_", "AWS_"))}


def test_compose_services_close_the_loop_on_local_kafka_and_s3(tmp_path):
    services = load_compose()["services"]
    broker = LocalBroker("memory").start()
    s3 = LocalS3().start()
    swaps = {
        "kafka:9092": broker.bootstrap_servers,
        "http://minio:9000": s3.endpoint_url,
        "/keys": str(tmp_path / "keys"),  # the compose volumes of the key pair
        "/pubkey": str(tmp_path / "pubkey"),
    }
    started: list[Service] = []

    def env_for(name: str, **extra: str) -> dict[str, str]:
        env = _base_env()
        env.update({k: _swap(v, swaps) for k, v in env_of(services[name]).items()})
        env.update(extra)
        return env

    def rlrec(name: str, log: str, **extra: str) -> Service:
        argv = [sys.executable, "-m", "rlrec", *(_swap(a, swaps) for a in command_list(services[name]))]
        svc = Service(name, argv, env_for(name, **extra), tmp_path / log)
        started.append(svc)
        return svc

    try:
        # topics: one-shot, must succeed
        topics = rlrec("topics", "topics.log")
        assert topics.proc.wait(120) == 0, topics.text()
        keygen = rlrec("keys", "keys.log")  # one-shot: the policy-signing key pair
        assert keygen.proc.wait(60) == 0, keygen.text()
        # minio-init: the bucket its `mc mb` creates
        (bucket,) = created_buckets(services["minio-init"])
        s3.create_bucket(bucket)

        metrics_port = free_port()
        consumer = rlrec(
            "consumer", "consumer.log", RLREC_METRICS_HOST="127.0.0.1", RLREC_METRICS_PORT=str(metrics_port)
        )
        trainer = rlrec("trainer", "trainer.log")
        policy_svc = services["policy"]
        (script,) = command_list(policy_svc)
        script = _swap(script, swaps).replace("exec python -m", f"exec {sys.executable} -m", 1)
        policies = []
        for i in range(int(policy_svc["deploy"]["replicas"])):
            svc = Service(
                f"policy-{i}", [*policy_svc["entrypoint"], script], env_for("policy"), tmp_path / f"policy-{i}.log"
            )
            started.append(svc)
            policies.append(svc)

        def acting_version() -> int:
            best = 0
            for p in policies:
                for line in p.text().splitlines():
                    if line.startswith("{"):
                        best = max(best, int(json.loads(line).get("policy_version") or 0))
            return best

        deadline = time.monotonic() + LOOP_TIMEOUT_S
        while time.monotonic() < deadline and acting_version() < 1:
            dead = [s.name for s in started if s.name not in ("topics", "keys") and s.proc.poll() is not None]
            assert not dead, f"{dead} exited early:\n" + "\n".join(f"--- {s.name}\n{s.text()[-3000:]}" for s in started)
            time.sleep(2)
        assert acting_version() >= 1, "no policy process acted with a published policy in time:\n" + "\n".join(
            f"--- {s.name}\n{s.text()[-3000:]}" for s in started
        )

        # stop in the demo's order: policies, then consumer and trainer (they flush / checkpoint)
        for p in policies:
            assert p.stop(60) == 0, p.text()[-3000:]
        assert consumer.stop(90) == 143, consumer.text()[-3000:]  # 128 + SIGTERM, after the clean stop
        trainer.stop(120)

        # what the compose user would look at: shards, manifest, checkpoints and policies on S3
        env = env_for("consumer")
        shards = _swap(env["RLREC_OUTPUT"], swaps)
        r = subprocess.run(
            [sys.executable, "-m", "rlrec", "inspect", shards, "--verify", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["totals"]["episodes"] > 0 and not doc["problems"]
        client = s3.client()
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="trainer/").get("Contents", [])]
        assert "trainer/policies/latest.json" in keys, keys
        assert "trainer/metrics.jsonl" in keys, keys
        latest = json.loads(client.get_object(Bucket=bucket, Key="trainer/policies/latest.json")["Body"].read())
        assert latest["policy_version"] >= 1
        assert f"trainer/policies/{latest['path']}/policy.json.sig" in keys  # signed, and the policies verified it
    finally:
        for svc in reversed(started):
            svc.stop(30)
        broker.stop()
        s3.stop()
