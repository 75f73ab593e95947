"""The collection's metadata agrees with the library's: one version (galaxy.yml,
pyproject.toml, shardfleet.__version__), the same collection dependencies as
requirements.yml, and a requires_ansible the ansible-core in use satisfies."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _galaxy() -> dict:
    return yaml.safe_load((ROOT / "galaxy.yml").read_text())


def _package_version() -> str:
    """shardfleet.__version__ as written in src/ (not whichever copy is installed)."""
    tree = ast.parse((ROOT / "src" / "shardfleet" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return str(ast.literal_eval(node.value))
    raise AssertionError("src/shardfleet/__init__.py has no __version__")


def test_one_version_for_the_collection_and_the_library() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    versions = {"galaxy.yml": str(_galaxy()["version"]), "pyproject.toml": pyproject,
                "shardfleet.__version__": _package_version()}
    assert len(set(versions.values())) == 1, f"versions disagree: {versions}"


def test_dependencies_are_requirements_yml() -> None:
    reqs = yaml.safe_load((ROOT / "requirements.yml").read_text())["collections"]
    assert _galaxy()["dependencies"] == {r["name"]: r["version"] for r in reqs}, (
        "galaxy.yml dependencies and requirements.yml name different collections or ranges")


def test_requires_ansible_is_the_core_in_use() -> None:
    from ansible.module_utils.compat.version import LooseVersion
    from ansible.release import __version__ as core

    spec = yaml.safe_load((ROOT / "meta" / "runtime.yml").read_text())["requires_ansible"]
    for clause in spec.split(","):
        op, ver = re.fullmatch(r"\s*(>=|<|<=|==|>)\s*([\d.]+)\s*", clause).groups()
        have, want = LooseVersion(core), LooseVersion(ver)
        ok = {">=": have >= want, "<": have < want, "<=": have <= want, "==": have == want,
              ">": have > want}[op]
        assert ok, f"ansible-core {core} does not satisfy requires_ansible {spec!r}"


def test_build_ignore_keeps_the_checkout_tooling_out() -> None:
    ignored = set(_galaxy()["build_ignore"])
    # .collections holds the symlink back to the root: building it would loop
    must = {".collections", ".ansible", ".venv", ".git", ".fleet", ".cache", "tests", "bench"}
    assert must <= ignored, f"build_ignore lacks {sorted(must - ignored)}"
