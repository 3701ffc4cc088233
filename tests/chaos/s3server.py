"""The chaos run's S3 servers (the shard store's, the broker's): moto in a process of its own.

    python -m tests.chaos.s3server BUCKET     # prints the port, serves until stdin closes

moto's conditional PUT is check-then-act (see tests/test_storage_manifest.py); real S3's is
atomic. PutObject is serialised here so the run tests our protocol, not moto's race.
A process each keeps the requests off the controller's GIL (moto serving Tansu's s3:// storage
in the controller took most of a core) and the two stores apart.
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


def main() -> int:
    _serialise_put_object()
    with LocalS3() as s3:
        s3.create_bucket(sys.argv[1])
        print(s3.port, flush=True)
        sys.stdin.read()  # until the controller closes our stdin (or dies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
