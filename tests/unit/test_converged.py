"""site.yml's fast path, shardfleet.fleet.converged: a host is known converged only while
everything its play reads is as the stamp says, the host still looks as the play left it
(the files, services and packages its stamp observed), and the stamp is young.

Real ansible-playbook runs on this host (local connection) with a temporary inventory and
stamp directory; a fake ``systemctl`` first on PATH answers for the services. The e2e tier
runs the same plays into the container fleet, with MariaDB, Redis and memcached observed
(its drift matrix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK_BIN = Path(sys.executable).parent / "ansible-playbook"

PLAY = """
- hosts: all
  gather_facts: false
  vars:  # the switches the tests turn come from the environment: an -e is an input
    units: "{{ lookup('ansible.builtin.env', 'SF_UNITS') | split(',') | select | list }}"
    managed: "{{ lookup('ansible.builtin.env', 'SF_FILES') | split(',') | select | list }}"
    stamp: "{{ lookup('ansible.builtin.env', 'SF_STAMP') != '0' }}"
    fast: "{{ lookup('ansible.builtin.env', 'SF_FAST') != '0' }}"
    age: "{{ lookup('ansible.builtin.env', 'SF_AGE') or 86400 }}"
  tasks:
    - name: a fact registered before the check changes nothing
      ansible.builtin.set_fact:
        noise: "{{ 999999 | random }}"
      when: lookup('ansible.builtin.env', 'SF_NOISE') == '1'
    - name: check
      shardfleet.fleet.converged:
        name: play
        path: "{{ stamps }}"
        enabled: "{{ fast | bool and (shardfleet_converged_fast_path | default(true) | bool) }}"
        max_age: "{{ age }}"
        paths: "{{ files | default([]) }}"
        inputs: "{{ more | default(omit) }}"
      register: c
      tags: [always]
    - name: stamp
      shardfleet.fleet.converged:
        name: play
        state: present
        path: "{{ stamps }}"
        digest: "{{ c.digest }}"
        observe: {services: "{{ units }}", files: "{{ managed }}"}
      register: s
      when: stamp | bool
      tags: [always]
"""

SYSTEMCTL = """#!/bin/sh
# systemctl is-active|is-enabled UNIT...: a unit named in $STATES_FILE is inactive, disabled
verb=$1
shift
for u in "$@"; do
  if grep -qx "$u" "$STATES_FILE" 2>/dev/null; then
    if [ "$verb" = is-active ]; then echo inactive; else echo disabled; fi
  else
    if [ "$verb" = is-active ]; then echo active; else echo enabled; fi
  fi
done
"""


def play_tasks(inventory: Path, playbook: Path, env: dict, args: tuple[str, ...]) -> list[dict]:
    """ansible-playbook's tasks (the json callback) of the one play, which must succeed."""
    p = subprocess.run(
        [str(PLAYBOOK_BIN), "-i", str(inventory),
         "-e", f"ansible_python_interpreter={sys.executable}", str(playbook), *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout)["plays"][0]["tasks"]


class Env:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.inventory = tmp / "inventory"
        (self.inventory / "group_vars" / "all").mkdir(parents=True)
        (self.inventory / "hosts.yml").write_text(
            "all:\n  hosts:\n    h1: {ansible_connection: local}\n")
        self.vars_file = self.inventory / "group_vars" / "all" / "main.yml"
        self.vars_file.write_text(
            "stamps: " + str(tmp / "stamps") + "\n"
            "port: 3306\n"
            "from_env: \"{{ lookup('ansible.builtin.env', 'SF_TEST_VALUE') }}\"\n"
            "app_password: \"{{ lookup('ansible.builtin.env', 'SF_TEST_SECRET') }}\"\n")
        self.playbook = tmp / "play.yml"
        self.playbook.write_text(PLAY)
        bindir = tmp / "bin"
        bindir.mkdir()
        (bindir / "systemctl").write_text(SYSTEMCTL)
        (bindir / "systemctl").chmod(0o755)
        self.states = tmp / "inactive-units"
        self.env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                        ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="json",
                        PATH=f"{bindir}:{os.environ['PATH']}", STATES_FILE=str(self.states),
                        SF_TEST_VALUE="one", SF_TEST_SECRET="s1")

    @property
    def stamp(self) -> Path:
        return self.tmp / "stamps" / "play.json"

    def run(self, *args: str, **env: str) -> dict[str, dict]:
        tasks = play_tasks(self.inventory, self.playbook, dict(self.env, **env), args)
        return {t["task"]["name"]: t["hosts"]["h1"] for t in tasks}

    def check(self, *args: str, **env: str) -> dict:
        return self.run(*args, **env)["check"]


@pytest.fixture()
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


def test_a_stamped_host_is_converged_until_an_input_changes(env: Env) -> None:
    first = env.run()
    assert first["check"]["converged"] is False and first["check"]["reason"] == "no stamp"
    assert first["stamp"]["written"] is True and env.stamp.exists()
    assert first["check"]["changed"] is False and first["stamp"]["changed"] is False
    again = env.check(SF_NOISE="1")  # a registered fact is not an input
    assert again["converged"] is True, again
    assert again["digest"] == first["check"]["digest"]

    env.vars_file.write_text(env.vars_file.read_text().replace("port: 3306", "port: 3307"))
    changed = env.check(SF_STAMP="0")
    assert changed == dict(changed, converged=False, reason="inputs changed")
    assert not env.stamp.exists(), "a stale stamp must go: a run that fails after it leaves none"


@pytest.mark.parametrize("how", ["extra var", "environment lookup", "control-node file", "inputs"])
def test_each_kind_of_input_is_in_the_digest(env: Env, how: str) -> None:
    ca = env.tmp / "ca.pem"
    ca.write_text("one")
    base = ("-e", f'{{"files": ["{ca}"], "more": {{"map": 1}}}}')
    env.run(*base)
    assert env.check(*base)["converged"] is True
    if how == "extra var":
        after = env.check(*base, "-e", "mysql_port=3307")
    elif how == "environment lookup":
        after = env.check(*base, SF_TEST_VALUE="two")
    elif how == "control-node file":
        ca.write_text("two")
        after = env.check(*base)
    else:
        after = env.check("-e", f'{{"files": ["{ca}"], "more": {{"map": 2}}}}')
    assert after["converged"] is False and after["reason"] == "inputs changed", after


def test_a_rotated_secret_changes_the_digest_which_holds_no_oracle_for_it(env: Env,
                                                                         tmp_path: Path) -> None:
    # a rotation (vault, lookup or -e) must reach the host; the digest, printed and kept on
    # the host, must not let a guess be tested against it: a keyed hash, key on the controller
    key = tmp_path / "key"
    first = env.run(SHARDFLEET_CONVERGED_KEY_FILE=str(key))["check"]
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 32
    assert env.check(SHARDFLEET_CONVERGED_KEY_FILE=str(key))["converged"] is True
    rotated = env.check(SHARDFLEET_CONVERGED_KEY_FILE=str(key), SF_TEST_SECRET="s2", SF_STAMP="0")
    assert rotated["converged"] is False and rotated["reason"] == "inputs changed", rotated
    env.run(SHARDFLEET_CONVERGED_KEY_FILE=str(key), SF_TEST_SECRET="s2")
    by_e = env.check("-e", "mysql_app_password=s3", SHARDFLEET_CONVERGED_KEY_FILE=str(key),
                     SF_TEST_SECRET="s2")
    assert by_e["converged"] is False and by_e["reason"] == "inputs changed", by_e
    # the same inputs under another key: another digest (the value alone does not make it)
    other = env.check(SHARDFLEET_CONVERGED_KEY_FILE=str(tmp_path / "other"), SF_STAMP="0")
    assert other["digest"] != first["digest"]


def test_an_observed_file_or_service_that_drifted_is_named_and_not_converged(env: Env) -> None:
    managed = env.tmp / "managed.conf"
    managed.write_text("max_connections = 100\n")
    env.run(SF_UNITS="svc-a,svc-b", SF_FILES=str(managed))
    assert env.check(SF_STAMP="0")["converged"] is True
    stamp = json.loads(env.stamp.read_text())
    assert set(stamp["observed"]) == {f"file:{managed}", "service:svc-a", "service:svc-b"}
    assert env.stamp.stat().st_mode & 0o777 == 0o600

    managed.write_text("max_connections = 7\n")
    edited = env.check(SF_STAMP="0")
    assert edited["converged"] is False, edited
    assert edited["reason"] == f"observed state differs: file:{managed}", edited
    assert edited["drift"] == [f"file:{managed}"]
    managed.write_text("max_connections = 100\n")

    env.run(SF_UNITS="svc-a,svc-b", SF_FILES=str(managed))
    env.states.write_text("svc-b\n")
    down = env.check(SF_STAMP="0")
    assert down["converged"] is False and down["drift"] == ["service:svc-b"], down
    env.states.unlink()

    env.run(SF_UNITS="svc-a", SF_FILES=str(managed))
    managed.chmod(0o600)  # a mode is state too
    assert env.check(SF_STAMP="0")["drift"] == [f"file:{managed}"]
    env.run(SF_UNITS="svc-a", SF_FILES=str(managed))
    managed.unlink()
    assert env.check(SF_STAMP="0")["drift"] == [f"file:{managed}"]


def test_an_old_stamp_or_moved_address_is_not_converged(env: Env) -> None:
    env.run(SF_UNITS="svc-a")
    stamp = json.loads(env.stamp.read_text())
    env.stamp.write_text(json.dumps(dict(stamp, time=time.time() - 1000)))
    old = env.check(SF_STAMP="0", SF_AGE="60")
    assert old["converged"] is False and old["reason"].startswith("stamp is 10"), old

    env.run()
    stamp = json.loads(env.stamp.read_text())
    env.stamp.write_text(json.dumps(dict(stamp, address="192.0.2.1")))
    moved = env.check(SF_STAMP="0")
    assert moved["converged"] is False, moved
    assert moved["reason"].startswith("address changed from 192.0.2.1"), moved


def test_the_drift_check_runs_in_full_and_a_narrowed_run_writes_no_stamp(env: Env) -> None:
    env.run()
    off = env.check(SF_FAST="0", SF_STAMP="0")
    assert off["converged"] is False and off["reason"].startswith("disabled"), off
    assert not env.stamp.exists()
    narrowed = env.run("--tags", "always")
    assert narrowed["stamp"]["written"] is False and "--tags" in narrowed["stamp"]["msg"]
    assert not env.stamp.exists()
    env.run("--check")
    assert not env.stamp.exists(), "check mode writes no stamp"


def test_the_drift_check_stamps_what_the_next_fast_run_accepts(env: Env) -> None:
    # the fast path's own switch is no input: the nightly full run leaves the fleet
    # converged for the next plain rerun
    env.run()
    full = env.run("-e", "shardfleet_converged_fast_path=false")
    assert full["check"]["converged"] is False and full["stamp"]["written"] is True
    assert env.check(SF_STAMP="0")["converged"] is True


# -- site.yml's own task files on two hosts (each its own stamps: one machine here) -----

SITE_PLAY = """
- hosts: fleet
  gather_facts: false
  tasks:
    - name: Observe
      ansible.builtin.import_tasks: {root}/playbooks/tasks/converged-observe.yml

- hosts: fleet
  gather_facts: false
  tasks:
    - name: Check
      ansible.builtin.import_tasks: {root}/playbooks/tasks/converged-check.yml
      vars:
        converged_name: play
        converged_gather_facts: false
    - name: work
      ansible.builtin.debug:
        msg: the play's full path
    - name: Stamp
      ansible.builtin.import_tasks: {root}/playbooks/tasks/converged-stamp.yml
      vars:
        converged_name: play
        converged_observe:
          files: ["{{{{ managed_file }}}}"]
"""


class SiteEnv:
    """Hosts h1 and h2 (local connection), each with its own stamp directory and its own
    managed file."""

    def __init__(self, tmp: Path) -> None:
        import yaml

        self.tmp = tmp
        self.inventory = tmp / "inventory"
        (self.inventory / "group_vars" / "all").mkdir(parents=True)
        self.files = {h: tmp / f"{h}.conf" for h in ("h1", "h2")}
        for f in self.files.values():
            f.write_text("setting 1\n")
        hosts = {h: {"ansible_connection": "local", "managed_file": str(f),
                     "shardfleet_converged_path": str(tmp / "stamps" / h),
                     "setting_of_h": f"{h}-1"} for h, f in self.files.items()}
        (self.inventory / "hosts.yml").write_text(yaml.safe_dump(
            {"all": {"children": {"fleet": {"hosts": hosts}}}}))
        (self.inventory / "group_vars" / "all" / "main.yml").write_text(
            "setting: \"{{ lookup('ansible.builtin.env', 'SF_TEST_VALUE') }}\"\n")
        self.playbook = tmp / "play.yml"
        self.playbook.write_text(SITE_PLAY.format(root=ROOT))
        self.env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                        ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="json",
                        SF_TEST_VALUE="one",
                        SHARDFLEET_CONVERGED_KEY_FILE=str(tmp / "converged.key"))

    def run(self, *args: str, **env: str) -> dict[str, dict[str, dict]]:
        p = subprocess.run(
            [str(PLAYBOOK_BIN), "-i", str(self.inventory),
             "-e", f"ansible_python_interpreter={sys.executable}", str(self.playbook), *args],
            capture_output=True, text=True, env=dict(self.env, **env), cwd=ROOT, timeout=300,
            check=False)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return {t["task"]["name"]: t["hosts"] for play in json.loads(p.stdout)["plays"]
                for t in play["tasks"]}

    @staticmethod
    def worked(res: dict[str, dict[str, dict]]) -> set[str]:
        return set(res.get("work", {}))

    @staticmethod
    def said(res: dict[str, dict[str, dict]]) -> str:
        """The play's one line about the fast path (run once)."""
        (line,) = [r["msg"] for k, v in res.items() if k.startswith("Say which")
                   for r in v.values()]
        return line


@pytest.fixture()
def senv(tmp_path: Path) -> SiteEnv:
    return SiteEnv(tmp_path)


def test_the_play_says_which_hosts_the_fast_path_ended_and_why_the_others_ran(senv) -> None:
    first = senv.run()
    assert senv.worked(first) == {"h1", "h2"}
    assert senv.said(first) == ("play: fast path (converged, checked) on no host; full path "
                                "on h1 (no stamp); h2 (no stamp)"), senv.said(first)
    second = senv.run()
    assert senv.worked(second) == set()
    assert senv.said(second) == ("play: fast path (converged, checked) on h1, h2; "
                                 "full path on no host")
    # decided on the control node from the first play's observation: no module ran
    checks = next(v for k, v in second.items() if k.startswith("Compare"))
    assert all("invocation" not in r for r in checks.values()), checks
    senv.files["h2"].write_text("setting 2\n")  # drift on h2 only
    third = senv.run()
    assert senv.worked(third) == {"h2"}
    assert senv.said(third) == (
        "play: fast path (converged, checked) on h1; full path on h2 (observed state "
        f"differs: file:{senv.files['h2']})"), senv.said(third)
    # the full run stamped h2 as it is now: the next run is fast everywhere
    assert senv.worked(senv.run()) == set()
    full = senv.run("-e", "shardfleet_converged_fast_path=false")
    assert senv.worked(full) == {"h1", "h2"} and "disabled" in senv.said(full)
    assert senv.worked(senv.run()) == set(), "the full run stamps what the next plain run takes"


def test_a_host_a_play_ran_in_full_on_is_observed_again_by_the_next_play(senv) -> None:
    # the first play's observation is from before this run changed anything: a host that
    # ran a play in full (a restart, a file rewritten) is observed again by the later plays
    second_play = SITE_PLAY.split("- hosts: fleet", 2)[2].replace("converged_name: play",
                                                                   "converged_name: second")
    senv.playbook.write_text((SITE_PLAY + "\n- hosts: fleet" + second_play).format(root=ROOT))
    senv.run()
    senv.files["h1"].write_text("setting 2\n")
    res = senv.run()
    compare = [res[f"Compare the host's stamp with this run's inputs and its state ({n})"]
               for n in ("play", "second")]
    # the file differs from both stamps: h1 runs both plays in full, the second one
    # observing h1 again (a module run), h2 takes the fast path twice (no module run)
    assert compare[0]["h1"]["converged"] is False and "invocation" not in compare[0]["h1"]
    assert compare[1]["h1"]["converged"] is False and "invocation" in compare[1]["h1"]
    assert compare[1]["h1"]["drift"] == [f"file:{senv.files['h1']}"]
    assert all("invocation" not in c["h2"] and c["h2"]["converged"] for c in compare)


def test_the_debug_file_names_each_part_and_variable_never_a_value(senv, tmp_path) -> None:
    dbg = tmp_path / "digests.jsonl"
    senv.run(SHARDFLEET_CONVERGED_DEBUG=str(dbg))
    senv.run(SHARDFLEET_CONVERGED_DEBUG=str(dbg), SF_TEST_VALUE="two")
    lines = [json.loads(x) for x in dbg.read_text().splitlines()]
    first = {x["host"]: x for x in lines[:2]}
    second = {x["host"]: x for x in lines[2:4]}
    assert set(first) == set(second) == {"h1", "h2"}, lines
    for h in ("h1", "h2"):
        a, b = first[h], second[h]
        assert a["parts"] == b["parts"] and a["digest"] != b["digest"]
        changed = {k for k in a["vars"] if a["vars"][k] != b["vars"].get(k)}
        assert changed == {"setting"}, changed
    assert "one" not in dbg.read_text(), "a value in the debug file"


MAP_PLAY = """
- hosts: fleet
  gather_facts: false
  vars:  # play variables are no input: only what converged_inputs names
    map_read: "{{{{ lookup('ansible.builtin.env', 'SF_MAP_READ') }}}}"
    map_left: "{{{{ lookup('ansible.builtin.env', 'SF_MAP_LEFT') }}}}"
  tasks:
    - name: Check
      ansible.builtin.import_tasks: {root}/playbooks/tasks/converged-check.yml
      vars:
        converged_name: play
        converged_inputs: {{map: "{{{{ map_read }}}}"}}
        converged_gather_facts: false
    - name: work
      ansible.builtin.debug:
        msg: the play's full path
    - name: Stamp
      ansible.builtin.import_tasks: {root}/playbooks/tasks/converged-stamp.yml
      vars:
        converged_name: play
        converged_stamp_inputs: {{map: "{{{{ map_left }}}}"}}
"""


def test_a_play_that_wrote_its_input_is_converged_with_what_it_wrote(senv) -> None:
    """site.yml's shards play reads the map, registers the first one, and stamps the map as
    it left it: the run after it is fast (it once ran the shards play in full, its stamp
    naming the map from before the first run). A map that changes after the play, by
    anyone, still sends the hosts down the full path."""
    senv.playbook.write_text(MAP_PLAY.format(root=ROOT))

    def worked(read: str, left: str) -> set[str]:
        return senv.worked(senv.run(SF_MAP_READ=read, SF_MAP_LEFT=left))
    assert worked("", "v1") == {"h1", "h2"}, "the first run (no map yet)"
    assert worked("v1", "v1") == set(), "the run after the map was written took the full path"
    assert worked("v2", "v2") == {"h1", "h2"}, "a map changed since was accepted"
    assert worked("v2", "v2") == set()
    # a play that read one map and left the same: the check's own digest, as before
    assert worked("v3", "v3") == {"h1", "h2"}
    assert worked("v3", "v3") == set()
