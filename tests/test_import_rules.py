"""The one installed namespace and its import rules (docs/ARCHITECTURE.md).

Layers, bottom to top: ``rlrec.producer`` -> ``rlrec.store`` -> ``rlrec.consumer`` | ``rlrec.trainer``
-> the application (``rlrec.cli``, ``rlrec.commands``, ``rlrec.local``, ``rlrec.demo``,
``rlrec.report*``, ...). A module imports only from its own layer and the layers below it;
``rlrec.consumer`` and ``rlrec.trainer`` never import each other. ``rlrec._lazy``,
``rlrec.options`` and ``rlrec.errors`` (they import nothing of ours) may be used by any layer. Checked on the source (every import statement,
function-level ones included), so an import that only runs on some code path is caught too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: repository folder -> installed package
FOLDERS = {
    "producer": "rlrec.producer",
    "store": "rlrec.store",
    "consumer": "rlrec.consumer",
    "trainer": "rlrec.trainer",
    "rlrec": "rlrec",
}
ALLOWED = {
    "producer": {"producer"},
    "store": {"producer", "store"},
    "consumer": {"producer", "store", "consumer"},
    "trainer": {"producer", "store", "trainer"},
    "app": {"producer", "store", "consumer", "trainer", "app"},
}
OLD_TOP_LEVEL = ("producer", "store", "consumer", "trainer")
#: modules of no layer: they import nothing of ours, and every layer may import them
LAYER_FREE = ("rlrec._lazy", "rlrec.errors", "rlrec.options")


def _layer(module: str) -> str | None:
    """The layer of one of our modules (None: not ours, or one of `LAYER_FREE`)."""
    if module in LAYER_FREE or not (module == "rlrec" or module.startswith("rlrec.")):
        return None
    for layer in ("producer", "store", "consumer", "trainer"):
        if module == f"rlrec.{layer}" or module.startswith(f"rlrec.{layer}."):
            return layer
    return "app"  # `rlrec` itself re-exports the trainer's load_policy, so it counts as app


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]] if rel.parts[0] != "rlrec" else "rlrec", *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(p for part in parts for p in part.split("."))


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # `from rlrec import store` imports the subpackage rlrec.store
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names if target == "rlrec"]
    return out


def _sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def test_layers_import_only_downwards():
    violations = []
    for path in _sources(*FOLDERS):
        module = _module_name(path)
        layer = _layer(module)
        if layer is None:
            continue
        for line, target in _imports(path, module):
            tl = _layer(target)
            if tl is not None and tl not in ALLOWED[layer]:
                violations.append(f"{path.relative_to(ROOT)}:{line}: {module} ({layer}) imports {target} ({tl})")
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("module", LAYER_FREE)
def test_layer_free_modules_import_nothing_of_ours(module):
    path = ROOT / "rlrec" / f"{module.split('.')[-1]}.py"
    ours = [t for _, t in _imports(path, module) if t == "rlrec" or t.startswith("rlrec.")]
    assert ours == []


def test_public_namespace_exports_no_test_harness():
    """`rlrec` re-exports the policy-side API and load_policy; the embedded test stack
    (LocalBroker, LocalS3) is imported from `rlrec.local`."""
    import rlrec

    assert not {"LocalBroker", "LocalS3"} & set(rlrec.__all__)
    assert not hasattr(rlrec, "LocalBroker")


def test_nothing_imports_the_old_top_level_names():
    """Inside the repository the folders are importable as top-level modules too (the working
    directory is on sys.path): importing one would load a second copy of every class in it."""
    bad = []
    for path in _sources(*FOLDERS, "tests", "bench"):
        module = _module_name(path) if path.relative_to(ROOT).parts[0] in FOLDERS else path.stem
        for line, target in _imports(path, module):
            if target.split(".")[0] in OLD_TOP_LEVEL:
                bad.append(f"{path.relative_to(ROOT)}:{line}: import {target}")
    assert not bad, "\n".join(bad)


def _run_from(tmp_path: Path, code: str) -> dict:
    """Run `code` in a fresh interpreter whose working directory is *not* the repository."""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_importing_every_module_loads_no_top_level_copy(tmp_path):
    code = (
        "import importlib, json, pkgutil, sys\n"
        "failed = []\n"
        "for name in ('rlrec', 'rlrec.producer', 'rlrec.store', 'rlrec.consumer', 'rlrec.trainer'):\n"
        "    pkg = importlib.import_module(name)\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, name + '.', onerror=failed.append):\n"
        "        if not m.name.endswith('__main__'):\n"
        "            importlib.import_module(m.name)\n"
        "mods = sorted(sys.modules)\n"
        f"print(json.dumps({{'failed': failed, 'ours': [m for m in mods if m.startswith('rlrec')],\n"
        f"                  'old': [m for m in mods if m.split('.')[0] in {OLD_TOP_LEVEL!r}]}}))\n"
    )
    out = _run_from(tmp_path, code)
    assert out["failed"] == []
    assert out["old"] == [], out["old"]
    for pkg in (
        "rlrec.producer.recorder",
        "rlrec.store.manifest",
        "rlrec.consumer.service",
        "rlrec.trainer.service",
        "rlrec.cli",
    ):
        assert pkg in out["ours"], pkg


def test_policy_side_import_needs_neither_ray_nor_torch(tmp_path):
    code = (
        "import json, sys\n"
        "from rlrec import EpisodeRecorder, MultiAgentRecordingWrapper, RecordingVectorWrapper, RecordingWrapper\n"
        "import rlrec.producer\n"
        "print(json.dumps({'heavy': sorted(m for m in ('ray', 'torch', 'pyarrow', 'pettingzoo') if m in sys.modules),\n"
        f"                  'old': [m for m in sys.modules if m.split('.')[0] in {OLD_TOP_LEVEL!r}],\n"
        "                  'file': rlrec.producer.__file__}))\n"
    )
    out = _run_from(tmp_path, code)
    assert out["heavy"] == [] and out["old"] == []
    assert Path(out["file"]).resolve() == (ROOT / "producer" / "__init__.py").resolve()
