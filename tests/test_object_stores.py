"""Every storage operation rlrec uses, on each object store (S3 on moto, GCS on fake-gcs-server,
Azure Blob on Azurite -- real servers on 127.0.0.1): create-once with one winner under races,
retries of transient errors, an ambiguous create-once resolved, refused credentials failing fast
with one line, and signed policies loaded from each store. The probe's refusal of stores that
ignore the precondition: tests/test_conditional_writes.py."""

from __future__ import annotations

import threading
import time

import gymnasium as gym
import numpy as np
import pytest

from rlrec.cli import main
from rlrec.store.azure import AzureSettings, split_azure_uri
from rlrec.store.storage import (
    RetryPolicy,
    Storage,
    StorageAccessError,
    StorageError,
    require_conditional_writes,
)
from tests.faults import FaultProxy

FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05)


def test_every_operation_rlrec_uses(object_store, monkeypatch, tmp_path):
    st = Storage.from_uri(object_store.output(monkeypatch, "exp"), retry=FAST_RETRY)
    assert st.conditional_writes and Storage.from_uri(st.uri("")).uri("") == st.uri("")
    st.write("pol/_staging/a.parquet", b"shard")
    st.write("pol/b.parquet", b"old")
    assert st.read("pol/_staging/a.parquet") == b"shard" and st.info("pol/b.parquet").size == 3
    assert st.exists("pol") and not st.exists("pol/none") and st.info("pol/none") is None
    # one level, directories included (GCS: through the client, pyarrow lists no implicit directory)
    assert [(f.name, f.is_dir) for f in st.list("pol")] == [("_staging", True), ("b.parquet", False)]
    assert [(f.path, f.is_dir) for f in st.list("")] == [("pol", True)]
    assert st.list("nothing") == []
    st.move("pol/_staging/a.parquet", "pol/a.parquet")  # publish (Azure: copy + delete)
    assert st.read("pol/a.parquet") == b"shard" and not st.exists("pol/_staging/a.parquet")
    with pytest.raises(FileNotFoundError):
        st.move("pol/_staging/gone", "pol/gone")
    with pytest.raises(FileNotFoundError):
        st.read("pol/gone")
    assert st.delete("pol/b.parquet") is True and st.delete("pol/b.parquet") is False
    assert st.create_once("_manifest/t/00000/1", b"entry") is True
    assert st.create_once("_manifest/t/00000/1", b"other") is False
    assert st.read("_manifest/t/00000/1") == b"entry"
    # bounded reads (manifest objects, shards): at most limit + 1 bytes, the whole object within it
    assert st.read("_manifest/t/00000/1", limit=2) == b"ent" and st.read("_manifest/t/00000/1", limit=5) == b"entry"
    st.write("big.bin", bytes(range(256)) * 12_000)  # ~3 MiB: more than one piece when the size is unknown
    assert st.read("big.bin", limit=10**9) == bytes(range(256)) * 12_000
    assert st.read("big.bin", limit=1_000_000) == (bytes(range(256)) * 12_000)[:1_000_001]
    assert st.delete("big.bin") is True
    src = tmp_path / "ckpt"
    (src / "learner").mkdir(parents=True)
    (src / "a.json").write_bytes(b"{}")
    (src / "learner" / "w.bin").write_bytes(b"\x00" * 10)
    assert st.upload_dir(src, "run/ckpt-1") == 2
    assert st.download_dir("run/ckpt-1", tmp_path / "back") == 2
    assert (tmp_path / "back" / "learner" / "w.bin").read_bytes() == b"\x00" * 10
    assert st.delete_tree("run/ckpt-1") == 2 and not st.exists("run/ckpt-1")
    assert require_conditional_writes(st) is True
    assert [f.name for f in st.list("_manifest")] == ["t"]  # the probe's key is gone


def test_create_once_has_exactly_one_winner_among_racing_writers(object_store, monkeypatch):
    uri = object_store.output(monkeypatch)
    stores = [Storage.from_uri(uri, retry=FAST_RETRY) for _ in range(8)]
    for key in ("_manifest/t/00000/claim-1", "_manifest/t/00000/claim-2"):
        wins: dict[int, bool] = {}
        barrier = threading.Barrier(len(stores))
        threads = [threading.Thread(target=_race, args=(st, i, key, barrier, wins)) for i, st in enumerate(stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        winners = [i for i, won in wins.items() if won]
        assert len(wins) == len(stores) and len(winners) == 1, wins
        assert stores[0].read(key) == f"writer {winners[0]}".encode()


def test_writes_and_publishes_are_atomic_for_readers(object_store, monkeypatch):
    """A reader never sees a partial object: not while a file is replaced (Azure: pyarrow's
    output stream would show an empty blob until it closes), not while a shard is published.
    The objects are small, as those rlrec replaces in place are (pointers, hints): pyarrow reads
    a large object in several requests, and a replacement between them is read as a torn mix."""
    st = Storage.from_uri(object_store.output(monkeypatch), retry=FAST_RETRY)
    old, new, shard = b"a" * 100_000, b"b" * 100_000, b"c" * 120_000
    st.write("pol/x", old)
    st.write("pol/_staging/y", shard)
    seen: set = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for path in ("pol/x", "pol/y"):
                try:
                    data = st.read(path)
                    seen.add((path, len(data), data[:1], data[-1:]))
                except FileNotFoundError:
                    seen.add((path, "missing"))

    reader = threading.Thread(target=watch)
    reader.start()
    try:
        for _ in range(3):
            st.write("pol/x", new)
            st.write("pol/x", old)
        st.move("pol/_staging/y", "pol/y")
        time.sleep(0.2)
    finally:
        stop.set()
        reader.join(30)
    whole = {("pol/x", len(old), b"a", b"a"), ("pol/x", len(new), b"b", b"b")}
    whole |= {("pol/y", "missing"), ("pol/y", len(shard), b"c", b"c")}
    assert seen <= whole, seen - whole
    assert st.read("pol/y") == shard and ("pol/x", len(old), b"a", b"a") in seen


def _race(st: Storage, i: int, key: str, barrier: threading.Barrier, wins: dict[int, bool]) -> None:
    barrier.wait()
    wins[i] = st.create_once(key, f"writer {i}".encode())


def test_transient_errors_are_retried_and_an_ambiguous_create_once_is_resolved(object_store, monkeypatch):
    proxy = FaultProxy(object_store.port)
    try:
        st = Storage.from_uri(object_store.output(monkeypatch, proxy_port=proxy.port), retry=FAST_RETRY)
        proxy.fail_next(2)  # 503 twice: retried, then it works
        st.write("a/x", b"1")
        assert st.read("a/x") == b"1"
        # the create reaches the store but its answer is lost: the retry meets our own bytes
        proxy.swallow_next(1)
        assert st.create_once("_manifest/e1", b"mine") is True
        proxy.swallow_next(1)  # ... or someone else's: not ours
        assert st.create_once("_manifest/e1", b"someone else's") is False
        proxy.fail_for(5.0)  # an outage longer than the retries: StorageError, never a wrong answer
        with pytest.raises(StorageError):
            st.create_once("_manifest/e2", b"x")
    finally:
        proxy.close()


def test_refused_credentials_fail_fast_with_one_line(local_azurite, monkeypatch, capsys):
    container = local_azurite.create_container("denied")
    wrong = local_azurite.connection_string().replace("AccountKey=Eby8", "AccountKey=AAAA")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
    # one retry would wait 60 s (no jitter): three refused calls well under that were not retried,
    # however slowly a busy machine makes them
    retry = RetryPolicy(attempts=5, base_delay=60.0, max_delay=60.0, jitter=0.0)
    st = Storage.from_uri(f"az://{container}/out", retry=retry)
    t0 = time.monotonic()
    for op in (lambda: st.create_once("_manifest/x", b"1"), lambda: st.read("x"), lambda: st.write("x", b"1")):
        with pytest.raises(StorageAccessError, match=r"access denied.*AZURE_STORAGE_CONNECTION_STRING"):
            op()
    assert time.monotonic() - t0 < 30  # not retried
    uri = f"az://{container}/out"
    for cmd in (["inspect", uri], ["consume", "--output", uri, "--bootstrap-servers", "127.0.0.1:1"]):
        capsys.readouterr()
        assert main(cmd) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "access denied" in err and "Traceback" not in err, err


def test_missing_google_credentials_fail_fast_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    assert main(["inspect", "gs://rlrec-no-such-bucket/out"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing.json" in err and "GOOGLE_APPLICATION_CREDENTIALS" in err, err


def test_azure_uris_and_settings(monkeypatch):
    assert split_azure_uri("az://runs/exp1/") == (None, "runs/exp1")
    assert split_azure_uri("abfss://runs@acct.dfs.core.windows.net/exp1") == ("acct", "runs/exp1")
    with pytest.raises(ValueError, match="names no container"):
        split_azure_uri("az:///exp1")
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    with pytest.raises(ValueError, match="no Azure storage account"):
        AzureSettings.from_env()
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "a2V5")
    s = AzureSettings.from_env()
    assert (s.blob_endpoint, s.account_key) == ("https://acct.blob.core.windows.net", "a2V5")
    st = Storage.from_uri("abfs://runs@other.dfs.core.windows.net/exp1")  # the URI's account wins
    assert st.uri("x") == "abfs://runs@other.dfs.core.windows.net/exp1/x"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    assert AzureSettings.from_env().blob_endpoint == "http://127.0.0.1:10000/devstoreaccount1"
    assert main(["inspect", "az:///nothing"]) == 2  # a URI without a container: one line, exit 2


def test_signed_policies_load_from_each_store(object_store, monkeypatch, tmp_path):
    from rlrec import load_policy
    from rlrec.trainer.signing import generate_keys, load_private_key
    from tests.test_policy_artifacts import build_module, publish

    root = object_store.output(monkeypatch, "run1/policies")
    priv, pub = generate_keys(tmp_path / "keys")
    space = gym.spaces.Discrete(2)
    for v in (1, 2):
        publish(root, build_module("BC", space, seed=v), space, v, signing_key=load_private_key(priv))
    p = load_policy(root, public_key=pub)
    assert p.policy_version == 2 and p.signed
    action, extra = p.act(np.zeros(4, np.float32))
    assert action in (0, 1) and np.isfinite(extra["action_logp"])
