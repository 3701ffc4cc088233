"""The chaos run's S3 servers (the shard store's, the broker's): moto in a process of its own.

    python -m tests.chaos.s3server BUCKET     # prints the port, serves until stdin closes

moto's conditional PUT is check-then-act (see tests/test_storage_manifest.py); real S3's is
atomic. PutObject is serialised here so the run tests our protocol, not moto's race.
A process each keeps the requests off the controller's GIL (moto serving Tansu's s3:// storage
in the controller took most of a core) and the two stores apart; moto's listing of timestamps,
a fifth of its time under Tansu, is cached.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from rlrec.local import LocalS3

REPO = Path(__file__).resolve().parents[2]


class S3Process(LocalS3):
    """A `LocalS3` whose server runs in a child process (this module); usable wherever a
    LocalS3 is (e.g. `LocalBroker("s3", s3=...)`). `stop()` ends the child."""

    def __init__(self, bucket: str, log_path: str | Path):
        super().__init__()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos.s3server", bucket],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log_path, "ab"),
        )
        self._port = int(self.proc.stdout.readline())
        self._server = self.proc  # running

    def start(self) -> S3Process:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the S3 server process exited with {self.proc.returncode}")
        return self

    def stop(self) -> None:
        self._server = None
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _serialise_put_object() -> None:
    from moto.s3.responses import S3Response

    orig = S3Response.put_object
    lock = threading.Lock()

    def put_object(self):  # type: ignore[no-untyped-def]
        with lock:
            return orig(self)

    S3Response.put_object = put_object


def _cache_listed_timestamps() -> None:
    """moto writes each listed object's LastModified by parsing its ISO text with dateutil, then
    formatting it again: with Tansu's thousands of objects that was a fifth of the broker's S3
    process (py-spy). The same text always gives the same result: remember it."""
    import functools

    from moto.core.serialize import TimestampSerializer

    original = TimestampSerializer._convert_timestamp_to_str
    stateless = TimestampSerializer(TimestampSerializer.TIMESTAMP_FORMAT_ISO8601)  # a new one per response

    @functools.lru_cache(maxsize=1 << 16)
    def remembered(value: str, timestamp_format: str) -> str:
        return original(stateless, value, timestamp_format)

    def convert(self, value, timestamp_format):  # type: ignore[no-untyped-def]
        if isinstance(value, str):
            return remembered(value, timestamp_format)
        return original(self, value, timestamp_format)

    TimestampSerializer._convert_timestamp_to_str = convert


def main() -> int:
    _serialise_put_object()
    _cache_listed_timestamps()
    with LocalS3() as s3:
        s3.create_bucket(sys.argv[1])
        print(s3.port, flush=True)
        sys.stdin.read()  # until the controller closes our stdin (or dies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
