"""The collection as ops teams get it: `ansible-galaxy collection build`, installed into a
temporary collections path, used from a directory outside the checkout with no
ansible.cfg. Every module and the connection render with `ansible-doc` (a module's doc
fragments resolve by FQCN), every role is found by FQCN and `ansible-doc -t role` shows
its argument specs (each entry point and option of its meta/argument_specs.yml), and
every playbook passes `--syntax-check` by FQCN (a playbook's FQCN is its file name with
'-' as '_': a '-' is not valid in one).

Runs in the lint tier (`make lint`); no servers, no network (`--offline`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GALAXY = yaml.safe_load((ROOT / "galaxy.yml").read_text())
NS = f"{GALAXY['namespace']}.{GALAXY['name']}"
MODULES = sorted(p.stem for p in (ROOT / "plugins" / "modules").glob("*.py"))
ROLES = sorted(p.parent.parent.name for p in (ROOT / "roles").glob("*/tasks/main.yml"))
PLAYBOOKS = sorted(p.name for p in (ROOT / "playbooks").glob("*.yml") if not p.is_symlink())
MAX_ARTIFACT = 2 * 1024 * 1024  # the artifact is ~0.3 MB; more means build_ignore let a tree in


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(an empty directory outside the checkout, an environment that sees only the built
    and installed collection and the collections bundled with ansible)."""
    tmp = tmp_path_factory.mktemp("collection")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(PATH=f"{BIN}:{env.get('PATH', '')}", ANSIBLE_NOCOLOR="1",
               ANSIBLE_COLLECTIONS_PATH=str(tmp / "collections"),
               ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"), ANSIBLE_HOME=str(tmp / "home"))
    build = _run([str(BIN / "ansible-galaxy"), "collection", "build", "--output-path",
                  str(tmp / "dist"), str(ROOT)], cwd=tmp, env=env)
    assert build.returncode == 0, (
        f"ansible-galaxy collection build failed:\n{build.stdout}{build.stderr}")
    (artifact,) = (tmp / "dist").glob("*.tar.gz")
    assert artifact.name == f"{GALAXY['namespace']}-{GALAXY['name']}-{GALAXY['version']}.tar.gz"
    size = artifact.stat().st_size
    assert size < MAX_ARTIFACT, f"{artifact.name} is {size} bytes: check build_ignore"
    with tarfile.open(artifact) as tar:
        names = tar.getnames()
    stray = [n for n in names if n.split("/")[0] in (
        ".collections", ".venv", ".git", ".ansible", ".fleet", ".cache", "tests", "bench")]
    assert not stray, f"the artifact carries checkout-only files: {stray[:10]}"
    assert "src/shardfleet/__init__.py" in names, "the artifact lacks the library (src/)"
    install = _run([str(BIN / "ansible-galaxy"), "collection", "install", "--offline",
                    "-p", str(tmp / "collections"), str(artifact)], cwd=tmp, env=env)
    assert install.returncode == 0, (
        f"ansible-galaxy collection install failed:\n{install.stdout}{install.stderr}")
    work = tmp / "elsewhere"
    work.mkdir()
    return work, env


def test_every_module_documents_itself(outside) -> None:
    cwd, env = outside
    names = [f"{NS}.{m}" for m in MODULES]
    p = _run([str(BIN / "ansible-doc"), "-t", "module", "--json", *names], cwd=cwd, env=env)
    assert p.returncode == 0 and not p.stderr.strip(), f"ansible-doc failed:\n{p.stderr}"
    docs = json.loads(p.stdout)
    missing = [n for n in names if not (docs.get(n) or {}).get("doc")]
    assert not missing, f"ansible-doc rendered no documentation for {missing}:\n{p.stderr}"
    for n in names:
        assert docs[n]["doc"]["collection"] == NS, n
        assert docs[n]["examples"], f"{n} has no EXAMPLES"


def test_every_filter_documents_itself(outside) -> None:
    cwd, env = outside
    names = [f"{NS}.{f.stem}" for f in sorted((ROOT / "plugins" / "filter").glob("*.yml"))]
    assert len(names) >= 5, names
    p = _run([str(BIN / "ansible-doc"), "-t", "filter", "--json", *names], cwd=cwd, env=env)
    assert p.returncode == 0 and not p.stderr.strip(), f"ansible-doc failed:\n{p.stderr}"
    docs = json.loads(p.stdout)
    missing = [n for n in names if not (docs.get(n) or {}).get("doc")]
    assert not missing, f"ansible-doc rendered no documentation for {missing}:\n{p.stderr}"


def test_the_connection_documents_itself(outside) -> None:
    """shardfleet.fleet.podman (the local fleet's pipelined podman connection) renders,
    its options with it: a doc that does not parse makes every task of the local fleet
    fail to load the plugin."""
    cwd, env = outside
    name = f"{NS}.podman"
    p = _run([str(BIN / "ansible-doc"), "-t", "connection", "--json", name], cwd=cwd, env=env)
    assert p.returncode == 0 and not p.stderr.strip(), f"ansible-doc failed:\n{p.stderr}"
    doc = json.loads(p.stdout)[name]["doc"]
    assert doc["collection"] == NS
    assert {"remote_addr", "remote_user", "podman_executable", "pipelining"} <= set(doc["options"])
    assert doc["options"]["pipelining"]["default"] is True


def test_a_module_runs_with_its_module_utils(outside) -> None:
    """AnsiballZ packs the collection's module_utils: the module gets as far as its
    connection (a closed port on 127.0.0.1), not an import error."""
    cwd, env = outside
    p = _run([str(BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local",
              "-e", f"ansible_python_interpreter={sys.executable}",
              "-m", f"{NS}.shard_databases", "-a",
              json.dumps({"login_port": 1, "range": [0, 1], "connect_timeout": 2})],
             cwd=cwd, env=env)
    out = p.stdout + p.stderr
    assert "cannot connect" in out and "Connection refused" in out, out[-3000:]


def test_every_role_is_found(outside) -> None:
    cwd, env = outside
    p = _run([str(BIN / "ansible-doc"), "-t", "role", "--list", "--json", NS], cwd=cwd,
             env=env)
    assert p.returncode == 0, f"ansible-doc -t role --list failed:\n{p.stderr}"
    assert sorted(json.loads(p.stdout)) == [f"{NS}.{r}" for r in ROLES], p.stdout


def test_every_role_documents_its_argument_specs(outside) -> None:
    """ansible-doc -t role renders each role's meta/argument_specs.yml from the installed
    copy: every entry point, every option, with its type (and `required` where the
    checkout's spec says so)."""
    cwd, env = outside
    p = _run([str(BIN / "ansible-doc"), "-t", "role", "--json", *(f"{NS}.{r}" for r in ROLES)],
             cwd=cwd, env=env)
    assert p.returncode == 0 and "ERROR" not in p.stderr, p.stderr
    docs = json.loads(p.stdout)
    for role in ROLES:
        spec = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
        shown = (docs.get(f"{NS}.{role}") or {}).get("entry_points") or {}
        assert set(shown) == set(spec["argument_specs"]), (
            f"ansible-doc -t role {NS}.{role} shows entry points {sorted(shown)}")
        for entry, want in spec["argument_specs"].items():
            options = shown[entry].get("options") or {}
            assert set(options) == set(want["options"]), (
                f"{NS}.{role}:{entry}: ansible-doc shows options {sorted(options)}")
            for name, opt in want["options"].items():
                assert options[name].get("type") == opt["type"], f"{role}:{entry}:{name}"
                assert bool(options[name].get("required")) == bool(opt.get("required")), name
    # and as text, the way an operator reads it
    p = _run([str(BIN / "ansible-doc"), "-t", "role", f"{NS}.mysql"], cwd=cwd, env=env)
    shown = re.search(r"ENTRY POINT: \W*main\b", p.stdout)
    assert p.returncode == 0 and shown, p.stdout[-2000:] + p.stderr
    assert "mysql_admin_password" in p.stdout and "mysql_server_id" in p.stdout, p.stdout[-2000:]


def test_every_playbook_passes_syntax_check_by_fqcn(outside) -> None:
    cwd, env = outside
    names = [f"{NS}.{Path(pb).stem.replace('-', '_')}" for pb in PLAYBOOKS]
    p = _run([str(BIN / "ansible-playbook"), "--syntax-check", *names], cwd=cwd, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"ansible-playbook --syntax-check failed:\n{out[-4000:]}"
    checked = {f"{NS}.{Path(line.split(':', 1)[1].strip()).stem}"
               for line in p.stdout.splitlines() if line.startswith("playbook:")}
    assert checked == set(names), f"not syntax-checked: {sorted(set(names) - checked)}"
