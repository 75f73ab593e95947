"""Every module's DOCUMENTATION, EXAMPLES and RETURN parse as YAML (ansible-doc refuses a
module whose documentation does not: a description with ': ' in it is enough), and every
option of its argument spec is documented."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "plugins" / "modules").glob("*.py"))


def test_no_role_embeds_a_module():
    """A role loaded from a collection (shardfleet.fleet.<role>) does not load its own
    library/ directory: the zookeeper role's module failed to resolve so (couldn't
    resolve module/action). Every module lives in plugins/modules."""
    embedded = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("roles/*/library/*"))
    assert not embedded, f"modules inside roles (move them to plugins/modules): {embedded}"


def _blocks(path: Path) -> dict[str, str]:
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id in ("DOCUMENTATION", "EXAMPLES", "RETURN"):
                    out[t.id] = str(node.value.value)
    return out


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_module_documentation_parses(path: Path) -> None:
    blocks = _blocks(path)
    assert set(blocks) == {"DOCUMENTATION", "EXAMPLES", "RETURN"}, path.name
    docs = yaml.safe_load(blocks["DOCUMENTATION"])
    assert docs["module"] == path.stem
    yaml.safe_load(blocks["EXAMPLES"])
    yaml.safe_load(blocks["RETURN"])
    options = set(docs.get("options") or {})
    # options the module declares itself (shared specs come with their doc fragments)
    declared = set(re.findall(r"^\s{8,12}(\w+)=dict\(type=", path.read_text(), re.M))
    assert declared <= options | {"zookeeper_hosts", "zookeeper_root", "cluster",
                                  "zookeeper_user", "zookeeper_password",
                                  "zookeeper_timeout", "login_host", "login_port",
                                  "login_user", "login_password", "login_unix_socket",
                                  "connect_timeout"}, sorted(declared - options)
