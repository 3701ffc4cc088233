"""The chaos run: exactly-once under kill -9, rebalances, storage faults and a broker restart.

    python -m tests.chaos --episodes N --kills K [--seed S] [--producers P] [--duration SECONDS]

Producer processes (tests.chaos.producer) publish N episodes and log their ground truth; `rlrec
consume` processes write shards to a local S3 server behind a fault proxy; the controller
(tests.chaos.controller) kills, rebalances, breaks the storage, lets a consumer of another output
join with the same group id and restarts the broker; the
checker (tests.chaos.check) compares every committed episode with the ground truth. The last
stdout line is `lost=<n> duplicated=<n>`; the exit code is 0 only if the run found nothing wrong.
"""
