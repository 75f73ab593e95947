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
                                  "connect_timeout", "ca_cert", "client_cert",
                                  "client_key", "check_hostname"}, sorted(declared - options)


def _fragment() -> dict[str, dict]:
    ns: dict = {}
    exec((ROOT / "plugins" / "doc_fragments" / "mysql.py").read_text(), ns)  # noqa: S102
    frag = ns["ModuleDocFragment"]
    return {"mysql": yaml.safe_load(frag.DOCUMENTATION)["options"],
            "mysql.tls": yaml.safe_load(frag.TLS)["options"]}


def test_the_mysql_fragment_documents_the_shared_specs_and_tls():
    """mysql_argument_spec() (login and TLS) and mysql_tls_argument_spec() are what the
    fragments shardfleet.fleet.mysql and shardfleet.fleet.mysql.tls document, with the
    same types and aliases."""
    import importlib.util

    spec_path = ROOT / "plugins" / "module_utils" / "shardfleet_common.py"
    spec = importlib.util.spec_from_file_location("_sf_common", spec_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    frag = _fragment()
    for name, args in (("mysql", mod.mysql_argument_spec()),
                       ("mysql.tls", mod.mysql_tls_argument_spec())):
        assert set(frag[name]) == set(args), (name, sorted(set(frag[name]) ^ set(args)))
        for opt, a in args.items():
            assert frag[name][opt]["type"] == a["type"], (name, opt)
            assert frag[name][opt].get("aliases", []) == a.get("aliases", []), (name, opt)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_a_module_taking_the_tls_options_documents_them(path: Path) -> None:
    """A module that logs in to MySQL over TCP takes ca_cert, client_cert, client_key and
    check_hostname (from the shared spec) and extends the fragment that documents them."""
    text = path.read_text()
    takes = "mysql_argument_spec()" in text or "mysql_tls_argument_spec()" in text
    frags = yaml.safe_load(_blocks(path)["DOCUMENTATION"]).get(
        "extends_documentation_fragment") or []
    documents = bool({"shardfleet.fleet.mysql", "shardfleet.fleet.mysql.tls"} & set(frags))
    assert takes == documents, (path.stem, takes, frags)
    if "topology.connect(" in text or "status.collect(" in text or "Options(" in text:
        if "unix_socket=" not in text:  # a local socket connection stays plain
            assert "mysql_tls(module)" in text or "mysql_connect(" in text, path.stem
