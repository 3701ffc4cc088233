"""`ManifestOfflineData.__init__` cannot call RLlib's `OfflineData.__init__` (it reads the whole
dataset), so it sets RLlib's attributes itself. This pins that copy to the installed RLlib: an
attribute a new RLlib assigns in `OfflineData.__init__` and `ManifestOfflineData` does not set
fails here, not at run time in some other `OfflineData` method."""

from __future__ import annotations

import ast
import inspect
import textwrap

from ray.rllib.offline.offline_data import OfflineData

import rlrec.trainer.data as data

#: attributes RLlib's `OfflineData.__init__` assigns that `ManifestOfflineData` deliberately does
#: not set, each with the reason. Empty: it sets all of them today.
DELIBERATELY_OMITTED: dict[str, str] = {}


def _self_attributes_assigned(fn) -> set[str]:
    """Names X of every `self.X = ...` (also `self.X: T = ...`, `self.X += ...`, `a = self.X = ...`
    and tuple targets) in the source of `fn`, nested blocks included."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))

    def names(target: ast.expr) -> set[str]:
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            return {target.attr}
        if isinstance(target, (ast.Tuple, ast.List)):
            return set().union(*(names(t) for t in target.elts))
        return set()

    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                found |= names(t)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            found |= names(node.target)
    return found


class _FakeFeed:
    """Stands in for the `ShardFeed` actor class: no Ray needed to construct the data object."""

    @classmethod
    def options(cls, **_kw):
        return cls

    @classmethod
    def remote(cls, *_a, **_kw):
        return object()


def test_the_parser_finds_rllibs_attributes():
    names = _self_attributes_assigned(OfflineData.__init__)
    # a few RLlib has had for many releases: if these are missing the parser is broken, not RLlib
    assert {"config", "path", "data", "batch_iterators", "map_batches_kwargs", "prelearner_class"} <= names


def test_manifest_offline_data_sets_every_attribute_rllibs_init_sets(tmp_path, monkeypatch):
    from ray.rllib.algorithms.bc import BCConfig

    monkeypatch.setattr(data, "ShardFeed", _FakeFeed)
    config = data.configure_continuous(BCConfig(), str(tmp_path))
    od = data.ManifestOfflineData(config)

    rllib = _self_attributes_assigned(OfflineData.__init__)
    stale = sorted(set(DELIBERATELY_OMITTED) - rllib)
    assert not stale, f"DELIBERATELY_OMITTED names attributes RLlib no longer assigns: {stale}"
    missing = sorted(rllib - set(vars(od)) - set(DELIBERATELY_OMITTED))
    assert not missing, (
        f"RLlib's OfflineData.__init__ assigns {missing}, which ManifestOfflineData.__init__ does not "
        "set: set them there (see what RLlib's methods expect of them) or list them in "
        "DELIBERATELY_OMITTED with the reason"
    )
