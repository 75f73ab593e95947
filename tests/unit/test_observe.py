"""The converged module's observed state (plugins/module_utils/observe.py): what it reads,
how it compares, and that site.yml's stamps observe every file a role writes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "observe", ROOT / "plugins" / "module_utils" / "observe.py")
assert _spec is not None and _spec.loader is not None
observe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(observe)


def test_option_names_are_the_server_sections_settings(tmp_path: Path) -> None:
    cnf = tmp_path / "60-shardfleet.cnf"
    cnf.write_text("# managed\n[client]\nport = 1\n[mysqld]\nport                     = 3306\n"
                   "skip_slave_start\nmax-connections = 7\n; comment\n[mariadb]\n"
                   "gtid_domain_id = 1\n")
    assert observe.option_names([str(cnf), str(tmp_path / "missing.cnf")]) == [
        "gtid_domain_id", "max_connections", "port", "skip_slave_start"]


def test_a_part_that_cannot_be_read_never_matches() -> None:
    assert observe.differences({"a": "1", "b": "2"}, {"a": "1", "b": "2"}) == []
    assert observe.differences({"a": "1"}, {"a": "2", "c": "x"}) == ["a", "c"]
    broken = {"mariadb:server": "error:OperationalError"}
    assert observe.differences(broken, broken) == ["mariadb:server"]


def test_a_file_s_content_mode_and_presence_are_its_state(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    d.mkdir()
    (d / "server.pem").write_text("one")
    before = observe.observe({"files": [str(d)]})
    assert before == observe.observe({"files": [str(d)]})
    (d / "server.pem").write_text("two")
    edited = observe.observe({"files": [str(d)]})
    (d / "server.pem").chmod(0o600)
    assert len({before[f"file:{d}"], edited[f"file:{d}"],
                observe.observe({"files": [str(d)]})[f"file:{d}"]}) == 3
    assert observe.observe({"files": [str(tmp_path / "gone")]}) == {
        f"file:{tmp_path / 'gone'}": "absent"}


def test_redis_settings_come_from_the_file_without_the_password(tmp_path: Path) -> None:
    conf = tmp_path / "redis.conf"
    conf.write_text("bind 10.0.0.1\nport 0\ntls-port 6379\nrequirepass s3cret\n"
                    "maxmemory 64mb\n# comment\n")
    names, cfg = observe.redis_settings(str(conf))
    assert names == ["bind", "maxmemory", "port", "tls-port"]
    assert cfg["requirepass"] == ["s3cret"]


# -- every file a role writes is in the stamp of the play that runs it --------------------

WRITERS = ("ansible.builtin.template", "ansible.builtin.copy")


def _dests(role: str) -> list[str]:
    out = []
    for f in sorted((ROOT / "roles" / role / "tasks").glob("*.yml")):
        for task in _tasks(yaml.safe_load(f.read_text()) or []):
            for module in WRITERS:
                if isinstance(task.get(module), dict) and "dest" in task[module]:
                    out.append(str(task[module]["dest"]))
    return out


def _tasks(items: list) -> list[dict]:
    out = []
    for t in items:
        out.append(t)
        for key in ("block", "rescue", "always"):
            out.extend(_tasks(t.get(key) or []))
    return out


def _anchor(dest: str) -> str:
    """What a stamp must name to cover *dest*: the variable it starts with, or its literal
    directory."""
    m = re.match(r"\{\{\s*([A-Za-z_][\w]*)", dest)
    if m:
        return m.group(1)
    literal = dest.split("{{", 1)[0]
    return literal.rsplit("/", 1)[0] if "/" in literal else literal


def _observed_text() -> dict[str, str]:
    """Per role, the text of the converged_observe of the play (or task file) running it."""
    out = {}
    for play in yaml.safe_load((ROOT / "playbooks" / "site.yml").read_text()):
        roles = [r["role"] if isinstance(r, dict) else r for r in play.get("roles") or []]
        for t in play.get("post_tasks") or []:
            observed = (t.get("vars") or {}).get("converged_observe")
            for r in roles:
                if observed is not None:
                    out[r.rsplit(".", 1)[-1]] = yaml.safe_dump(observed)
    library = yaml.safe_load((ROOT / "playbooks" / "tasks" / "library.yml").read_text())
    out["shards"] = yaml.safe_dump([t.get("vars") for t in library])
    return out


def test_every_file_a_role_writes_is_observed_by_its_play_s_stamp() -> None:
    texts = _observed_text()
    assert {"mysql", "zookeeper", "redis", "memcached", "monitoring", "shards"} <= set(texts)
    missing = []
    for role, text in texts.items():
        dests = _dests(role)
        if role in ("mysql", "redis"):  # they include tls_cert into <role>_tls_dir
            dests += [d.replace("tls_cert_dir", f"{role}_tls_dir") for d in _dests("tls_cert")]
        assert dests, role
        missing += [f"{role}: {d}" for d in dests if _anchor(d) not in text]
    assert not missing, f"written by a role, not observed by its stamp: {missing}"
