"""Canary rollout, the publication and service sides (real files, a real signing key):

* ``canary.json`` (signed like ``latest.json``) names a candidate above the deployed version; a
  service that restarts meanwhile is not refused as replaying ``latest.json`` (the anti-rollback
  check excuses exactly the canary's version), with or without opting in;
* ``load_policy(canary_fraction=f)`` + ``for_episode`` serve the canary to a deterministic,
  salted share of episodes, across restarts and through ``poll()``;
* promotion and rollback keep versions monotonic and every state file satisfied; a rollback is
  a new, higher version with the deployed weights; each decision is signed in ``rollout.json``;
* what an attacker who can write the folder (no key) tries: an unsigned or foreign canary
  pointer, a canary of another base, an old latest/canary pair replayed after a promotion;
* the publish root's lease: two trainers on one root cannot both publish.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlrec.store.storage import Storage  # noqa: E402
from rlrec.trainer.canary import canary_score, in_canary  # noqa: E402
from rlrec.trainer.canary_publish import end_canary, write_canary  # noqa: E402
from rlrec.trainer.export import prepare_publication  # noqa: E402
from rlrec.trainer.holdout import is_held_out  # noqa: E402
from rlrec.trainer.policy import PolicyLoadError, load_policy  # noqa: E402
from rlrec.trainer.publish_lease import PublishLease, PublishRootTaken  # noqa: E402
from rlrec.trainer.signing import generate_keys, load_private_key, verify  # noqa: E402
from tests.test_policy_binding import ACT, OBS, RUN_A, artifact, publish  # noqa: E402

OBS_BATCH = np.random.default_rng(0).normal(0, 1, (64, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    priv, pub = generate_keys(tmp_path_factory.mktemp("keys"))
    return {"private": load_private_key(priv), "public": str(pub)}


def canary(root, version, key, *, base, started=None, channel="prod", run_id=RUN_A) -> None:
    """Put `version` on canary above `base`, as the trainer does (pointer first, then the files);
    `started` (the pointer's time too) defaults to now."""
    started = time.time() if started is None else started
    pub = prepare_publication(
        algo=None,
        version=version,
        algo_name="BC",
        observation_space=OBS,
        action_space=ACT,
        iteration=version,
        timesteps_trained=0,
        shards=[],
        new_shards=[],
        parent_version=base or None,
        signing_key=key,
        artifact=artifact(2, version),
        run_id=run_id,
        channel=channel,
    )
    write_canary(Storage.from_uri(str(root)), pub, key, base_version=base, started=started)


@pytest.fixture
def on_canary(tmp_path, keys):
    """v1..v4 deployed (latest.json names v4), v5 on canary above it."""
    root = tmp_path / "root"
    for v in (1, 2, 3, 4):
        publish(root, v, keys["private"])
    canary(root, 5, keys["private"], base=4)
    return root


def same_weights(a, b) -> bool:
    return np.array_equal(a.action_dist_inputs(OBS_BATCH), b.action_dist_inputs(OBS_BATCH))


# ------------------------------------------------------------------------------ the split


def test_the_canary_split_is_salted_apart_from_the_holdout_split():
    ids = [f"episode-{i}" for i in range(20_000)]
    canary_ids = {i for i in ids if in_canary(i, 0.1)}
    held_out = {i for i in ids if is_held_out(i, 0.1)}
    assert 1_800 < len(canary_ids) < 2_200
    # independent splits overlap on about f * f of the episodes; the same hash would overlap fully
    assert len(canary_ids & held_out) < 0.02 * len(ids)
    assert {i for i in ids if in_canary(i, 0.05)} <= canary_ids  # a larger share is a superset
    assert canary_score("episode-1") == canary_score("episode-1")


# -------------------------------------------------------------------- restarts and the state file


def test_a_restart_during_a_canary_is_not_refused_as_a_replay(on_canary, tmp_path, keys):
    state = tmp_path / "svc" / "state.json"
    # a service that does not opt in keeps the deployed version (the replay check used to refuse v4)
    plain = load_policy(str(on_canary), public_key=keys["public"], channel="prod", state_file=tmp_path / "plain.json")
    assert (plain.policy_version, plain.canary_version) == (4, None)
    assert plain.for_episode("e1").policy_version == 4

    p = load_policy(str(on_canary), public_key=keys["public"], channel="prod", state_file=state, canary_fraction=0.2)
    assert (p.policy_version, p.canary_version) == (4, 5)
    assert json.loads(state.read_bytes())["policy_version"] == 4
    assert json.loads(state.read_bytes())["canary_version"] == 5
    ids = [f"ep-{i}" for i in range(2_000)]
    served = {i: p.for_episode(i) for i in ids}
    on = [i for i, a in served.items() if a.policy_version == 5]
    assert 300 < len(on) < 500
    assert all(served[i].canary == in_canary(i, 0.2) for i in ids)
    actor, version = served[on[0]]
    assert version == actor.policy_version == 5 and actor.canary
    action, extra = actor.act(OBS_BATCH[0])
    assert action in (0, 1) and "action_logp" in extra
    v5 = load_policy(str(on_canary), version=5, public_key=keys["public"])
    np.testing.assert_array_equal(actor._version.forward(OBS_BATCH).numpy(), v5.action_dist_inputs(OBS_BATCH))

    # restart: the same episodes get the same versions, and the state file is satisfied
    q = load_policy(str(on_canary), public_key=keys["public"], channel="prod", state_file=state, canary_fraction=0.2)
    assert {i: q.for_episode(i).policy_version for i in ids} == {i: a.policy_version for i, a in served.items()}
    assert q.poll() is False


def test_promotion_and_rollback_keep_versions_monotonic(on_canary, tmp_path, keys):
    storage = Storage.from_uri(str(on_canary))
    state = tmp_path / "state.json"
    p = load_policy(str(on_canary), public_key=keys["public"], channel="prod", state_file=state, canary_fraction=0.5)
    v4 = load_policy(str(on_canary), version=4, public_key=keys["public"])
    decision = {"decision": "rollback", "reason": "the upper bound -1 of canary - deployed is below 0"}
    deployed = end_canary(
        storage,
        keys["private"],
        version=5,
        base_version=4,
        promote=False,
        decision=decision,
        run_id=RUN_A,
        channel="prod",
    )
    assert deployed == 4  # latest.json stays on the base: nothing is signed again as a new version
    assert not (on_canary / "canary.json").exists() and not (on_canary / "v000006").exists()
    rollout = (on_canary / "v000005" / "rollout.json").read_bytes()
    verify(keys["private"].public_key(), rollout, (on_canary / "v000005" / "rollout.json.sig").read_bytes())
    assert json.loads(rollout)["decision"] == "rollback"
    ended = (on_canary / "v000005" / "canary-ended.json").read_bytes()
    verify(keys["private"].public_key(), ended, (on_canary / "v000005" / "canary-ended.json.sig").read_bytes())
    sha = hashlib.sha256((on_canary / "v000005" / "policy.json").read_bytes()).hexdigest()
    bound = {"sha256": sha, "channel": "prod", "run_id": json.loads(rollout)["run_id"]}
    assert json.loads(ended) == {"canary_version": 5, "decision": "rollback", "deployed_version": 4, **bound}
    assert {k: json.loads(rollout)[k] for k in bound} == bound
    assert json.loads((on_canary / "latest.json").read_bytes())["policy_version"] == 4
    assert p.poll() is True
    assert (p.policy_version, p.canary_version) == (4, None)
    assert same_weights(p, v4)
    assert json.loads(state.read_bytes())["policy_version"] == 4
    # a restart after the rollback: the signed rollback record excuses v5 (no replay), the state file is satisfied
    for fraction in (0.0, 0.5):
        q = load_policy(
            str(on_canary), public_key=keys["public"], channel="prod", state_file=state, canary_fraction=fraction
        )
        assert (q.policy_version, q.canary_version) == (4, None)
    # carrying the decision out again (a resumed trainer) changes nothing
    assert (
        end_canary(
            storage,
            keys["private"],
            version=5,
            base_version=4,
            promote=False,
            decision=decision,
            run_id=RUN_A,
            channel="prod",
        )
        == 4
    )
    assert not (on_canary / "v000006").exists()

    # the next canary, above the rolled-back one, then a promotion
    canary(on_canary, 6, keys["private"], base=4)
    assert p.poll() is True and (p.policy_version, p.canary_version) == (4, 6)
    assert (
        end_canary(
            storage,
            keys["private"],
            version=6,
            base_version=4,
            promote=True,
            decision={"decision": "promote"},
            run_id=RUN_A,
            channel="prod",
        )
        == 6
    )
    assert p.poll() is True and (p.policy_version, p.canary_version) == (6, None)
    assert json.loads(state.read_bytes())["policy_version"] == 6
    v6 = load_policy(str(on_canary), version=6, public_key=keys["public"])
    assert same_weights(p, v6)


def test_each_assignment_carries_what_to_log_while_a_canary_runs(on_canary, keys):
    from rlrec.trainer.canary import read_assignment

    p = load_policy(str(on_canary), public_key=keys["public"], channel="prod", canary_fraction=0.3)
    for eid in (f"e{i}" for i in range(50)):
        a = p.for_episode(eid)
        assert read_assignment(a.info, eid) == (5, a.canary, 0.3)
        # the canary's identity: the sha256 of its policy.json, as the signed canary.json names it
        assert a.info["rlrec_canary"]["sha256"] == json.loads((on_canary / "canary.json").read_bytes())["sha256"]
    plain = load_policy(str(on_canary), public_key=keys["public"], channel="prod")  # not opted in
    assert plain.for_episode("e1").info == {}


def test_a_first_version_on_canary_serves_the_rest_what_ran_before(tmp_path, keys):
    root = tmp_path / "root"
    canary(root, 1, keys["private"], base=0)
    with pytest.raises(PolicyLoadError, match=r"no latest\.json"):
        load_policy(str(root), public_key=keys["public"], channel="prod")
    p = load_policy(str(root), public_key=keys["public"], channel="prod", canary_fraction=0.3)
    assert (p.policy_version, p.canary_version) == (0, 1)
    ids = [f"e{i}" for i in range(300)]
    assert {p.for_episode(i) for i in ids if not in_canary(i, 0.3)} == {(None, 0)}
    assert {p.for_episode(i).policy_version for i in ids if in_canary(i, 0.3)} == {1}
    with pytest.raises(PolicyLoadError, match=r"nothing is deployed .* yet"):
        p.act(OBS_BATCH[0])
    end_canary(
        Storage.from_uri(str(root)),
        keys["private"],
        version=1,
        base_version=0,
        promote=True,
        decision={"decision": "promote"},
        run_id=RUN_A,
        channel="prod",
    )
    assert p.poll() is True and (p.policy_version, p.canary_version) == (1, None)
    # rolled back with nothing deployed before: the canary pointer goes, nothing is republished
    canary(root, 2, keys["private"], base=1)
    assert p.poll() is True and p.canary_version == 2


# ----------------------------------------------------------------------------- hostile pointers


def test_canary_pointers_an_attacker_can_write_are_not_followed(on_canary, tmp_path, keys, caplog):
    # unsigned canary pointer (the key is configured): refused, and it excuses nothing
    good = (on_canary / "canary.json").read_bytes(), (on_canary / "canary.json.sig").read_bytes()
    (on_canary / "canary.json.sig").unlink()
    for fraction in (0.0, 0.5):
        with pytest.raises(PolicyLoadError, match=r"v000005, signed for the same channel, exists"):
            load_policy(str(on_canary), public_key=keys["public"], channel="prod", canary_fraction=fraction)
    # a running service keeps serving the deployed version to every episode
    (on_canary / "canary.json.sig").write_bytes(good[1])
    p = load_policy(str(on_canary), public_key=keys["public"], channel="prod", canary_fraction=0.5)
    assert p.canary_version == 5
    (on_canary / "canary.json.sig").unlink()
    assert p.poll() is True
    assert (p.policy_version, p.canary_version, p.canary_refusals) == (4, None, 1)
    assert "canary.json is not signed by the configured key" in caplog.text
    # edited after signing
    (on_canary / "canary.json").write_bytes(good[0].replace(b'"base_version": 4', b'"base_version": 3'))
    (on_canary / "canary.json.sig").write_bytes(good[1])
    assert p.poll() is False and p.canary_version is None and "does not verify" in caplog.text
    # a genuine canary of another channel does not excuse this channel's v5
    other = tmp_path / "other"
    for v in (1, 2, 3, 4):
        publish(other, v, keys["private"], channel="staging")
    canary(other, 5, keys["private"], base=4, channel="staging")
    shutil.copy(other / "canary.json", on_canary / "canary.json")
    shutil.copy(other / "canary.json.sig", on_canary / "canary.json.sig")
    with pytest.raises(PolicyLoadError, match=r"v000005, signed for the same channel, exists"):
        load_policy(str(on_canary), public_key=keys["public"], channel="prod")
    # a canary of another base is not followed
    (on_canary / "canary.json").write_bytes(good[0])
    (on_canary / "canary.json.sig").write_bytes(good[1])
    publish(on_canary, 6, keys["private"])  # latest.json moves past the canary's base
    p = load_policy(str(on_canary), public_key=keys["public"], channel="prod", canary_fraction=0.5)
    assert (p.policy_version, p.canary_version) == (6, None)


def test_an_old_pointer_pair_replayed_after_a_promotion_is_refused_by_the_state_file(on_canary, tmp_path, keys):
    state = tmp_path / "state.json"
    pair = {
        n: (on_canary / n).read_bytes() for n in ("latest.json", "latest.json.sig", "canary.json", "canary.json.sig")
    }
    p = load_policy(str(on_canary), public_key=keys["public"], channel="prod", state_file=state, canary_fraction=0.5)
    end_canary(
        Storage.from_uri(str(on_canary)),
        keys["private"],
        version=5,
        base_version=4,
        promote=True,
        decision={"decision": "promote"},
        run_id=RUN_A,
        channel="prod",
    )
    assert p.poll() is True and p.policy_version == 5
    for name, data in pair.items():  # genuine, signed, old
        (on_canary / name).write_bytes(data)
    with pytest.raises(PolicyLoadError, match=r"names v4, older than v5 in use: rollback refused"):
        p.poll()
    with pytest.raises(PolicyLoadError, match=r"v000004 is older than v000005, which this service has loaded"):
        load_policy(str(on_canary), public_key=keys["public"], channel="prod", state_file=state, canary_fraction=0.5)


def test_an_old_pointer_pair_replayed_after_a_promotion_is_refused_without_a_state_file(on_canary, tmp_path, keys):
    """A new replica (no state file) finds genuine old latest.json(v4) + canary.json(v5 over 4)
    after v5 was promoted: v5 is marked decided, so it excuses nothing and v4 is a replay."""
    pair = {
        n: (on_canary / n).read_bytes() for n in ("latest.json", "latest.json.sig", "canary.json", "canary.json.sig")
    }
    end_canary(
        Storage.from_uri(str(on_canary)),
        keys["private"],
        version=5,
        base_version=4,
        promote=True,
        decision={"decision": "promote"},
        run_id=RUN_A,
        channel="prod",
    )
    assert (on_canary / "v000005" / "canary-ended.json").exists()
    for name, data in pair.items():
        (on_canary / name).write_bytes(data)
    for fraction in (0.0, 0.2):
        with pytest.raises(PolicyLoadError, match=r"v000005, signed for the same channel, exists: a replayed old"):
            load_policy(str(on_canary), public_key=keys["public"], channel="prod", canary_fraction=fraction)


def test_a_replayed_canary_pointer_of_a_rolled_back_first_version_is_not_served(tmp_path, keys):
    """A first canary (base 0) rolled back: replaying its signed canary.json serves it neither to
    a running service nor to one restarted with its state file."""
    root = tmp_path / "root"
    canary(root, 1, keys["private"], base=0)
    old = {n: (root / n).read_bytes() for n in ("canary.json", "canary.json.sig")}
    state = tmp_path / "svc.json"
    svc = load_policy(str(root), public_key=keys["public"], channel="prod", canary_fraction=0.2, state_file=state)
    assert svc.canary_version == 1
    end_canary(
        Storage.from_uri(str(root)),
        keys["private"],
        version=1,
        base_version=0,
        promote=False,
        decision={"decision": "rollback"},
        run_id=RUN_A,
        channel="prod",
    )
    svc.poll()
    assert svc.canary_version is None
    for name, data in old.items():
        (root / name).write_bytes(data)
    svc.poll()
    assert svc.canary_version is None
    with pytest.raises(PolicyLoadError, match=r"no policy is published .* no usable canary.json"):
        load_policy(str(root), public_key=keys["public"], channel="prod", canary_fraction=0.2, state_file=state)


# ------------------------------------------------------------------------------- the lease


def test_two_publishers_on_one_root_cannot_both_publish(tmp_path):
    storage = Storage.from_uri(str(tmp_path / "policies"))
    first = PublishLease(storage, ttl_s=0.6, writer="first")
    first.acquire()
    second = PublishLease(storage, ttl_s=0.6, writer="second")
    with pytest.raises(PublishRootTaken, match=r"another trainer publishes to .*writer first"):
        second.acquire()  # the first renews its lease: after waiting, refused
    first.check()
    # the first dies without a clean stop (its lease is no longer renewed): the second waits it out
    first._stop.set()
    first._thread.join()
    second.acquire()
    with pytest.raises(PublishRootTaken, match=r"taken by writer second"):
        first.check()
    second.release()
    third = PublishLease(storage, ttl_s=60.0, writer="third")
    done = threading.Event()
    third._sleep = lambda s: done.set()  # a released lease is taken at once: no wait
    third.acquire()
    assert not done.is_set()
    # a lease of a process of this host that is gone (a trainer killed here) is taken at once
    import os
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    from rlrec.store.ownership import renew_lease
    from rlrec.trainer.publish_lease import _process_namespace

    here = _process_namespace()
    # the same pid in another PID namespace (a container sharing the hostname): waited out, not taken
    renew_lease(
        storage,
        "publisher",
        0,
        writer=f"{socket.gethostname()}:{gone.stdout.strip()}:x:othernamespace",
        epoch=4,
        ttl_s=60,
    )
    with pytest.raises(PublishRootTaken):
        PublishLease(storage, ttl_s=60.0, writer="other-ns", sleep=lambda s: None).acquire(max_wait_s=0.0)
    renew_lease(
        storage, "publisher", 0, writer=f"{socket.gethostname()}:{gone.stdout.strip()}:x:{here}", epoch=5, ttl_s=60
    )
    fourth = PublishLease(storage, ttl_s=60.0, writer="fourth", sleep=lambda s: done.set())
    fourth.acquire()
    assert not done.is_set() and fourth.epoch == 6
    renew_lease(storage, "publisher", 0, writer=f"{socket.gethostname()}:{os.getppid()}:x:{here}", epoch=7, ttl_s=60)
    with pytest.raises(PublishRootTaken):  # a live process of this host: refused
        PublishLease(storage, ttl_s=60.0, writer="fifth", sleep=lambda s: None).acquire(max_wait_s=0.0)
    fourth.release()
    third.release()


def test_a_fenced_trainer_publishes_nothing(tmp_path, monkeypatch):
    from tests.test_policy_binding import _trainer

    keys_dir = tmp_path / "keys"
    generate_keys(keys_dir)
    t = _trainer(tmp_path, keys_dir, monkeypatch, resume=False)
    lease = PublishLease(t.publish_storage, ttl_s=30.0, writer="first")
    lease.acquire()
    t.hold_publish_lease(lease)
    t.iteration = 3
    t.checkpoint()
    assert (tmp_path / "ckpt" / "policies" / "v000001" / "policy.json").exists()
    # another trainer takes the root (as it would after judging this one dead)
    from rlrec.store.ownership import renew_lease

    renew_lease(t.publish_storage, "publisher", 0, writer="second", epoch=2, ttl_s=30.0)
    t.iteration = 6
    committed = t.checkpoints.resume_point(0)
    with pytest.raises(PublishRootTaken, match=r"taken by writer second"):
        t.checkpoint()
    assert not (tmp_path / "ckpt" / "policies" / "v000002").exists()
    assert t.checkpoints.resume_point(0) == committed  # nor a checkpoint another trainer would resume
    assert json.loads((tmp_path / "ckpt" / "policies" / "latest.json").read_bytes())["policy_version"] == 1
    t.publish_lease._stop.set()


def test_a_trainer_whose_root_was_taken_mid_publication_writes_nothing_more(tmp_path, monkeypatch):
    """The review's race: trainer A passes its lease check, then its writes slow down and its
    renewals fail; B, judging A dead, takes the root and publishes v1. Every write of A's after
    B's claim is refused (the fencing log's create-once), so v1 is B's alone and loadable."""
    import time

    from rlrec.trainer.export import highest_reserved, highest_version, write_publication
    from rlrec.trainer.publish_lease import FencedStorage
    from tests.test_policy_binding import RUN_B

    keys_dir = tmp_path / "keys"
    priv, pub = generate_keys(keys_dir)
    key = load_private_key(priv)
    root = tmp_path / "policies"

    def publication(version, seed, run_id):
        return prepare_publication(
            algo=None,
            version=version,
            algo_name="BC",
            observation_space=OBS,
            action_space=ACT,
            iteration=version,
            timesteps_trained=0,
            shards=[],
            new_shards=[],
            parent_version=None,
            signing_key=key,
            artifact=artifact(2, seed),
            run_id=run_id,
            channel="prod",
        )

    a_raw = Storage.from_uri(str(root))
    a_lease = PublishLease(a_raw, ttl_s=30.0, writer="trainer-A")
    a_lease.acquire()
    a_lease._stop.set()  # A's renewals stop reaching the store
    a_lease._thread.join()
    a_store = FencedStorage(a_raw, a_lease)
    b_started = threading.Event()
    real_write = a_raw.write

    def slow(rel, data):
        if not rel.startswith("_owners/"):
            b_started.wait(60)
            time.sleep(0.2)
        real_write(rel, data)

    monkeypatch.setattr(a_raw, "write", slow)
    a_lease.check()  # passes: A holds the root
    failed = []

    def a_publishes():
        try:
            write_publication(a_store, publication(1, 1, RUN_A), key)
        except PublishRootTaken as e:
            failed.append(e)

    thread = threading.Thread(target=a_publishes)
    thread.start()
    reserved = root / "_owners" / "publisher" / "versions" / f"{1:012d}"
    deadline = time.monotonic() + 60
    while not reserved.exists() and time.monotonic() < deadline:  # A reserved v1, its first file write waits
        time.sleep(0.01)
    b_raw = Storage.from_uri(str(root))
    from rlrec.store.ownership import release_lease

    release_lease(b_raw, "publisher", 0, writer="trainer-A", epoch=1, ttl_s=30.0)  # A's lease lapsed
    b_lease = PublishLease(b_raw, ttl_s=30.0, writer="trainer-B")
    b_lease.acquire()
    b_started.set()
    signed = highest_version(b_raw, key)
    version = max(signed, highest_reserved(b_raw, signed)) + 1  # as the trainer numbers
    assert version == 2  # A reserved v1 before writing into it
    write_publication(FencedStorage(b_raw, b_lease), publication(version, 2, RUN_B), key)
    thread.join()
    b_lease.release()
    assert failed, "A went on publishing after B took the root"
    p = load_policy(str(root), public_key=str(pub), channel="prod")
    assert p.policy_version == 2 and p.run_id == RUN_B
    assert not (root / "v000001" / "policy.json").exists()  # A's one write in flight stayed in A's version


def test_a_publication_whose_number_another_writer_reserved_is_dropped_not_retried(tmp_path, monkeypatch):
    from rlrec.trainer.export import reserve_version
    from tests.test_policy_binding import _trainer

    keys_dir = tmp_path / "keys"
    generate_keys(keys_dir)
    t = _trainer(tmp_path, keys_dir, monkeypatch, resume=False)
    root = tmp_path / "ckpt" / "policies"
    real = t._next_version
    monkeypatch.setattr(t, "_next_version", lambda: 1)  # numbered before the other writer reserved v1
    reserve_version(Storage.from_uri(str(root)), 1, b"another writer's publication")
    t.iteration = 3
    t.checkpoint()
    assert not t._pending and not (root / "v000001" / "policy.json").exists()
    monkeypatch.setattr(t, "_next_version", real)
    t.iteration = 6
    t.checkpoint()
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 2


def test_a_checkpoint_directory_finds_a_first_canary(tmp_path, keys):
    """load_policy(<checkpoint dir>) during a first canary (no latest.json yet) follows
    policies/canary.json, as it follows policies/latest.json."""
    canary(tmp_path / "ckpt" / "policies", 1, keys["private"], base=0)
    p = load_policy(str(tmp_path / "ckpt"), public_key=keys["public"], channel="prod", canary_fraction=0.3)
    assert p.canary_version == 1


def test_a_canary_pointer_older_than_max_pointer_age_is_not_served(on_canary, keys):
    """A trainer that died leaves its canary.json behind: services that check pointer ages
    (max_pointer_age_s, the knob for a dead trainer) stop serving a canary whose pointer its
    trainer stopped re-signing; the trainer's refresh (`refresh_canary`) keeps a live one served."""
    from rlrec.store.storage import Storage
    from rlrec.trainer.canary_publish import refresh_canary

    kw = {"base_version": 4, "started": 0.0, "channel": "prod"}
    assert refresh_canary(Storage.from_uri(str(on_canary)), 5, keys["private"], **kw, now=0.0)  # signed in 1970
    p = load_policy(
        str(on_canary),
        public_key=keys["public"],
        channel="prod",
        canary_fraction=0.3,
        max_pointer_age_s=3600,
        max_canary_age_s=None,
    )
    assert p.policy_version == 4 and p.canary_version is None
    assert refresh_canary(Storage.from_uri(str(on_canary)), 5, keys["private"], **kw)
    p.poll()
    assert p.canary_version == 5
    assert not refresh_canary(Storage.from_uri(str(on_canary)), 6, keys["private"], **kw)  # no signed v6
    assert not refresh_canary(Storage.from_uri(str(on_canary)), 5, keys["private"], **{**kw, "channel": "staging"})


def test_an_end_record_copied_into_another_version_does_not_excuse_a_replay(tmp_path):
    """Every rolled-back canary leaves a genuine signed "rollback" ``canary-ended.json``. Copied into
    the deployed versions' directories (v3, v4) beside the genuine old ``latest.json`` (v1), it made
    the replay check take them for never deployed: new replicas deployed v1 while v4 was deployed.
    A record names its version: in another directory it is none, and the replay is refused."""
    priv, pub = generate_keys(tmp_path / "keys")
    key = load_private_key(priv)
    root = tmp_path / "root"
    st = Storage.from_uri(str(root))
    publish(root, 1, key)
    old_pointer = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig")}
    canary(root, 2, key, base=1)
    end_canary(
        st,
        key,
        version=2,
        base_version=1,
        promote=False,
        decision={"decision": "rollback"},
        run_id=RUN_A,
        channel="prod",
    )
    publish(root, 3, key)
    canary(root, 4, key, base=3)
    end_canary(
        st, key, version=4, base_version=3, promote=True, decision={"decision": "promote"}, run_id=RUN_A, channel="prod"
    )
    assert load_policy(str(root), public_key=str(pub), channel="prod").policy_version == 4
    for v in (3, 4):
        for name in ("canary-ended.json", "canary-ended.json.sig"):
            shutil.copy(root / "v000002" / name, root / f"v{v:06d}" / name)
    for name, data in old_pointer.items():
        (root / name).write_bytes(data)
    with pytest.raises(PolicyLoadError, match="replayed old pointer"):
        load_policy(str(root), public_key=str(pub), channel="prod")


def test_a_replayed_first_canary_pointer_is_below_the_state_file(tmp_path):
    """v1 went on canary above nothing (base 0) and was promoted; v2..v5 deployed; a service with a
    state file loaded v5. A key-less writer deletes latest.json and v1's end record and restores
    the genuine first canary.json (v1, base 0): the restarting service came up on "nothing
    deployed", running what it ran before for 95 % of its episodes and v1 for the rest. The state
    file refuses both: nothing deployed after v5, and a canary below v5."""
    priv, pub = generate_keys(tmp_path / "keys")
    key = load_private_key(priv)
    root = tmp_path / "root"
    canary(root, 1, key, base=0)
    old = {n: (root / n).read_bytes() for n in ("canary.json", "canary.json.sig")}
    st = Storage.from_uri(str(root))
    end_canary(
        st, key, version=1, base_version=0, promote=True, decision={"decision": "promote"}, run_id=RUN_A, channel="prod"
    )
    for v in (2, 3, 4, 5):
        publish(root, v, key)
    state = tmp_path / "svc-state.json"
    assert load_policy(str(root), public_key=str(pub), channel="prod", state_file=str(state)).policy_version == 5
    (root / "latest.json").unlink()
    (root / "latest.json.sig").unlink()
    (root / "v000001" / "canary-ended.json").unlink()
    for n, data in old.items():
        (root / n).write_bytes(data)
    with pytest.raises(PolicyLoadError, match=r"no latest\.json .* loaded v000005 before"):
        load_policy(str(root), public_key=str(pub), channel="prod", state_file=str(state), canary_fraction=0.05)
    # the canary check alone: a canary below the deployed version this service loaded is refused
    from rlrec.trainer.binding import Pins
    from rlrec.trainer.policy_verify import _check_state

    with pytest.raises(PolicyLoadError, match="older than v000005"):
        _check_state("v000001", Pins(state_file=str(state)), canary=True)
    _check_state("v000006", Pins(state_file=str(state)), canary=True)


@pytest.mark.parametrize("fraction", [0.6, 1.0, -0.1])
def test_a_canary_fraction_above_the_tests_half_is_refused(on_canary, keys, fraction):
    """canary_fraction 1.0 was accepted: such a service served the untested canary to all its
    traffic and gave its test nothing (no episode of it lies in the test's band)."""
    with pytest.raises(PolicyLoadError, match=r"canary_fraction must be in \[0, 0\.5\]"):
        load_policy(str(on_canary), public_key=keys["public"], channel="prod", canary_fraction=fraction)
    p = load_policy(str(on_canary), public_key=keys["public"], channel="prod", canary_fraction=0.5)
    assert p.canary_version == 5


@pytest.mark.parametrize("limit", ["3600", float("nan"), float("inf"), -1, 0, True])
def test_a_bad_max_canary_age_is_refused_at_load(on_canary, keys, limit):
    """max_canary_age_s was not checked (review-40f F5): "3600" loaded and the first poll with a
    canary on raised a bare TypeError in the service, NaN switched the limit off, -1 refused
    every canary."""
    with pytest.raises(PolicyLoadError, match="bad max_canary_age_s: max_canary_age_s must be a positive finite"):
        load_policy(
            str(on_canary), public_key=keys["public"], channel="prod", canary_fraction=0.2, max_canary_age_s=limit
        )
    for ok in (None, 1, 2.5, np.float32(60)):
        p = load_policy(
            str(on_canary), public_key=keys["public"], channel="prod", canary_fraction=0.2, max_canary_age_s=ok
        )
        assert p.canary_version == 5


def test_a_fencing_entry_written_by_a_call_that_failed_is_this_trainers_own(tmp_path):
    """A fencing create-once that was applied but reported failed (a 5xx after the write), retried
    by the caller with a new entry (another time, another write), compared unequal: the trainer
    took its own entry for another trainer's and exited 2 "taken by another trainer"."""
    storage = Storage.from_uri(str(tmp_path / "root"))
    lease = PublishLease(storage, ttl_s=60.0, writer="first")
    lease.acquire()
    real, failed = storage.create_once, {"n": 0}

    def applied_then_failed(path, data):
        if "fence" in path and not failed["n"]:
            failed["n"] = 1
            real(path, data)
            raise OSError("503 after the write was applied")
        return real(path, data)

    storage.create_once = applied_then_failed
    with pytest.raises(OSError):
        lease.fence("write v000001/policy.json")
    lease.fence("write v000001/policy.json")  # the caller's retry
    assert lease.lost is None
    lease.fence("write latest.json")
    assert lease.lost is None
    lease.release()
