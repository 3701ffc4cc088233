"""`rlrec demo`: the whole closed loop on one machine (see `rlrec.demo.run`).

Modules: `processes` (child processes: start with a log file, stop SIGTERM -> wait -> SIGKILL),
`policy_process` (one simulated deployed policy: a process of its own), `dashboard` (collects the
numbers and shows them), `run` (the orchestration), `datadir` (the data-dir layout).
"""
