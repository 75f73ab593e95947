"""site.yml's fast path, shardfleet.fleet.converged: a host is known converged only while
everything its play reads is as the stamp says, its services run, and the stamp is young.

Real ansible-playbook runs on this host (local connection) with a temporary inventory and
stamp directory; a fake ``systemctl`` first on PATH answers for the services. The e2e tier
runs the same plays into the container fleet.
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
        services: "{{ units }}"
      register: s
      when: stamp | bool
      tags: [always]
"""

SYSTEMCTL = """#!/bin/sh
# systemctl is-active UNIT...: a unit named in $STATES_FILE is inactive
shift
rc=0
for u in "$@"; do
  if grep -qx "$u" "$STATES_FILE" 2>/dev/null; then echo inactive; rc=3; else echo active; fi
done
exit $rc
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


def test_a_secret_is_not_templated_into_the_digest(env: Env) -> None:
    # the digest is printed and kept on the host: a guess at a secret must not be testable
    # against it. The secret's written source (a vault file, an -e argument) is hashed.
    env.run()
    assert env.check(SF_TEST_SECRET="s2")["converged"] is True


def test_an_inactive_service_old_stamp_or_moved_address_is_not_converged(env: Env) -> None:
    env.run(SF_UNITS="svc-a,svc-b")
    assert env.check(SF_STAMP="0")["converged"] is True
    env.states.write_text("svc-b\n")
    down = env.check(SF_STAMP="0")
    assert down["converged"] is False and down["reason"] == "not active: svc-b", down
    env.states.unlink()

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


# -- a keeper (shardfleet_converged_keeper): one host keeps every host's stamps ------------
# The play is site.yml's own task files: the check once for the play on the keeper, the
# ports each host's stamp names probed from there, meta end_host for the converged hosts.

KEEPER_PLAY = """
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
"""


TWO_PLAYS = KEEPER_PLAY + KEEPER_PLAY.replace("converged_name: play", "converged_name: second")


class KeeperEnv:
    """Hosts h1, h2 and the keeper k (all local connection); each host's service is a
    listening socket of this test, named in the inventory as the host's converged_ports."""

    def __init__(self, tmp: Path) -> None:
        import socket

        self.tmp = tmp
        self.listeners = {}
        for h in ("h1", "h2"):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(16)
            self.listeners[h] = s
        self.stamps = tmp / "stamps"
        self.inventory = tmp / "inventory"
        (self.inventory / "group_vars" / "all").mkdir(parents=True)
        self.keeper_vars = {"shardfleet_converged_keeper": "k"}
        self.write_inventory()
        (self.inventory / "group_vars" / "all" / "main.yml").write_text(
            f"shardfleet_converged_path: {self.stamps}\n"
            f"shardfleet_address: 127.0.0.1\n"
            "setting: \"{{ lookup('ansible.builtin.env', 'SF_TEST_VALUE') }}\"\n")
        self.playbook = tmp / "play.yml"
        self.playbook.write_text(KEEPER_PLAY.format(root=ROOT))
        self.env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                        ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="json",
                        SF_TEST_VALUE="one")

    def write_inventory(self, keeper: dict | None = None, own_paths: bool = False) -> None:
        """*own_paths*: each host its own stamp directory (h1 and h2 are one machine here)."""
        import yaml

        hosts = {h: {"ansible_connection": "local",
                     "converged_ports": [s.getsockname()[1]],
                     "setting_of_h": f"{h}-1"} for h, s in self.listeners.items()}
        for h in hosts if own_paths else ():
            hosts[h]["shardfleet_converged_path"] = str(self.stamps / "own" / h)
        inv = {"all": {"vars": self.keeper_vars,
                       "hosts": {"k": keeper or {"ansible_connection": "local"}},
                       "children": {"fleet": {"hosts": hosts}}}}
        (self.inventory / "hosts.yml").write_text(yaml.safe_dump(inv))

    def close(self, host: str) -> None:
        self.listeners[host].close()

    def two_plays(self) -> None:
        """site.yml's shape: plays one after another, each with its own stamp."""
        self.playbook.write_text(TWO_PLAYS.format(root=ROOT))

    def kept(self, host: str) -> Path:
        return self.stamps / "hosts" / host / "play.json"

    def run(self, *args: str, **env: str) -> dict[str, dict[str, dict]]:
        tasks = play_tasks(self.inventory, self.playbook, dict(self.env, **env), args)
        return {t["task"]["name"]: t["hosts"] for t in tasks}

    def run_plays(self, *args: str) -> list[set[str]]:
        """The hosts that ran each play's full path."""
        p = subprocess.run(
            [str(PLAYBOOK_BIN), "-i", str(self.inventory),
             "-e", f"ansible_python_interpreter={sys.executable}", str(self.playbook), *args],
            capture_output=True, text=True, env=self.env, cwd=ROOT, timeout=300, check=False)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return [set(next((t["hosts"] for t in play["tasks"] if t["task"]["name"] == "work"),
                         {})) for play in json.loads(p.stdout)["plays"]]

    @staticmethod
    def worked(res: dict[str, dict[str, dict]]) -> set[str]:
        return set(res.get("work", {}))


@pytest.fixture()
def kenv(tmp_path: Path):
    e = KeeperEnv(tmp_path)
    yield e
    for s in e.listeners.values():
        s.close()


def check_of(res: dict[str, dict[str, dict]]) -> dict:
    """The check's result (run once: under the play's first host)."""
    (r,) = [v for k, v in res.items() if k.startswith("Compare")][0].values()
    return r


def test_a_keeper_checks_the_whole_play_at_once_and_ends_the_converged_hosts(kenv) -> None:
    first = kenv.run()
    assert kenv.worked(first) == {"h1", "h2"}
    c = check_of(first)
    assert c["converged_hosts"] == [] and set(c["reasons"]) == {"h1", "h2"}, c
    for h in ("h1", "h2"):
        kept = json.loads(kenv.kept(h).read_text())
        assert kept["address"] == "127.0.0.1"
        assert kept["ports"] == [kenv.listeners[h].getsockname()[1]], kept
    assert not (kenv.stamps / "play.json").exists(), "a stamp of the keeper's own kind"
    second = kenv.run()
    assert kenv.worked(second) == set(), "converged hosts ran the play's full path"
    assert check_of(second)["converged_hosts"] == ["h1", "h2"]
    # an input of one host: that host only
    kenv.write_inventory()
    third = kenv.run(SF_TEST_VALUE="two")
    assert kenv.worked(third) == {"h1", "h2"}, "an input every host reads changed"
    assert kenv.worked(kenv.run(SF_TEST_VALUE="two")) == set()


def test_a_host_whose_port_is_closed_runs_in_full_and_loses_every_stamp(kenv) -> None:
    kenv.run()
    other = kenv.stamps / "hosts" / "h2" / "other-play.json"
    other.write_text(kenv.kept("h2").read_text())
    kenv.close("h2")
    res = kenv.run()
    assert kenv.worked(res) == {"h2"}, res.get("work")
    reason = check_of(res)["reasons"]["h2"]
    assert reason.startswith("not listening on 127.0.0.1: port "), reason
    assert not other.exists(), "a host that failed its check kept another play's stamp"
    # it stamped again at the end of its full run; its port is still closed: full again
    assert kenv.worked(kenv.run()) == {"h2"}


def test_an_unreachable_keeper_fails_no_run_and_leaves_every_host_on_the_full_path(kenv) -> None:
    kenv.run()
    kenv.write_inventory(keeper={"ansible_connection": "ssh", "ansible_host": "127.0.0.1",
                                 "ansible_port": 1, "ansible_ssh_timeout": 3})
    res = kenv.run()
    assert kenv.worked(res) == {"h1", "h2"}
    kenv.write_inventory()
    assert kenv.worked(kenv.run()) == set(), "the stamps of the earlier run are still good"


def test_with_a_keeper_the_drift_check_runs_in_full_and_narrowed_runs_write_no_stamp(kenv) -> None:
    kenv.run()
    res = kenv.run("-e", "shardfleet_converged_fast_path=false")
    assert kenv.worked(res) == {"h1", "h2"}
    assert kenv.worked(kenv.run()) == set(), "the drift check's stamps are not accepted"
    for h in ("h1", "h2"):
        kenv.kept(h).unlink()
    kenv.run("--tags", "always")
    assert not kenv.kept("h1").exists() and not kenv.kept("h2").exists()


def test_an_empty_keeper_means_each_host_keeps_its_own_stamps(kenv) -> None:
    kenv.write_inventory(own_paths=True)
    kenv.run("-e", "shardfleet_converged_keeper=")
    assert not (kenv.stamps / "hosts").exists(), "stamps went to a keeper"
    for h in ("h1", "h2"):
        assert (kenv.stamps / "own" / h / "play.json").exists(), f"no stamp of {h}'s own"
    res = kenv.run("-e", "shardfleet_converged_keeper=")
    assert kenv.worked(res) == set()
    assert set(check_of_each(res)) == {"h1", "h2"}, "the check did not run on each host"


def check_of_each(res: dict[str, dict[str, dict]]) -> dict[str, dict]:
    return [v for k, v in res.items() if k.startswith("Compare")][0]


def test_a_first_run_leaves_every_play_s_stamp_and_the_next_run_is_fast(kenv) -> None:
    """The first run of a fleet (no stamps at all) must leave a stamp per play: a later
    play's check finding no stamp of its own once removed the stamps the earlier plays
    had just written, so every run of a bench fleet took the full path."""
    kenv.two_plays()
    assert kenv.run_plays() == [{"h1", "h2"}, {"h1", "h2"}]
    for h in ("h1", "h2"):
        assert kenv.kept(h).exists() and (kenv.kept(h).parent / "second.json").exists(), h
    assert kenv.run_plays() == [set(), set()], "the run after the first took the full path"
    # a closed port in the second play: that host's stamps all go, the next run is full
    # for it in both plays and fast for the other
    kenv.close("h2")
    assert kenv.run_plays() == [{"h2"}, {"h2"}]


def test_the_debug_file_names_each_part_and_variable_never_a_value(kenv, tmp_path) -> None:
    dbg = tmp_path / "digests.jsonl"
    kenv.run(SHARDFLEET_CONVERGED_DEBUG=str(dbg))
    kenv.run(SHARDFLEET_CONVERGED_DEBUG=str(dbg), SF_TEST_VALUE="two")
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


@pytest.mark.parametrize("keeper", [True, False], ids=["keeper", "own stamps"])
def test_a_play_that_wrote_its_input_is_converged_with_what_it_wrote(kenv, keeper) -> None:
    """site.yml's shards play reads the map, registers the first one, and stamps the map as
    it left it: the run after it is fast (it once ran the shards play in full, its stamp
    naming the map from before the first run). A map that changes after the play, by
    anyone, still sends the hosts down the full path."""
    kenv.playbook.write_text(MAP_PLAY.format(root=ROOT))
    args = () if keeper else ("-e", "shardfleet_converged_keeper=")
    if not keeper:
        kenv.write_inventory(own_paths=True)

    def worked(read: str, left: str) -> set[str]:
        return kenv.worked(kenv.run(*args, SF_MAP_READ=read, SF_MAP_LEFT=left))

    assert worked("", "v1") == {"h1", "h2"}, "the first run (no map yet)"
    assert worked("v1", "v1") == set(), "the run after the map was written took the full path"
    assert worked("v2", "v2") == {"h1", "h2"}, "a map changed since was accepted"
    assert worked("v2", "v2") == set()
    # a play that read one map and left the same: the check's own digest, as before
    assert worked("v3", "v3") == {"h1", "h2"}
    assert worked("v3", "v3") == set()
