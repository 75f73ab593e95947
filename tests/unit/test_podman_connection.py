"""The collection's podman connection (shardfleet.fleet.podman): a module is one pipelined
``podman exec -i``, files go in and out on standard streams, and a command's exit code
comes back as it was.

The podman here is a script that logs its arguments and runs the exec'd command on this
host (the container is the test's directory), so the connection's own protocol is what
is under test; the e2e tier runs every task of site.yml through it into real containers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE = Path(sys.executable).parent / "ansible"

FAKE_PODMAN = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
assert args[0] == "exec", args
args = args[1:]
stdin = subprocess.DEVNULL
if args[0] == "-i":
    stdin, args = None, args[1:]
if args[0] == "--user":
    args = args[2:]
container, argv = args[0], args[1:]
if container not in ("c1", "c2"):
    sys.stderr.write(f"Error: no container with name or ID {{container!r}} found\\n")
    sys.exit(125)
sys.exit(subprocess.run(argv, stdin=stdin).returncode)
"""


@pytest.fixture()
def podman(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "podman.log"
    script = tmp_path / "podman"
    script.write_text(FAKE_PODMAN.format(python=sys.executable, log=str(log)))
    script.chmod(0o755)
    return script, log


def adhoc(podman: Path, module: str, args: str, host: str = "c1") -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="json")
    env.pop("ANSIBLE_PIPELINING", None)
    return subprocess.run(
        [str(ANSIBLE), "all", "-i", f"{host},", "-c", "shardfleet.fleet.podman",
         "-e", f"ansible_podman_executable={podman}",
         "-e", f"ansible_python_interpreter={sys.executable}",
         "-m", module, "-a", args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False)


def result(p: subprocess.CompletedProcess, host: str = "c1") -> dict:
    out = json.loads(p.stdout)
    return out["plays"][0]["tasks"][0]["hosts"][host]


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_module_is_one_pipelined_podman_exec(podman):
    script, log = podman
    p = adhoc(script, "ansible.builtin.ping", "data=pong")
    assert p.returncode == 0, p.stdout + p.stderr
    assert result(p)["ping"] == "pong"
    made = calls(log)
    assert len(made) == 1, made
    assert made[0][:3] == ["exec", "-i", "c1"], made


def test_a_file_goes_in_and_comes_back(podman, tmp_path):
    script, log = podman
    src = tmp_path / "src.conf"
    src.write_bytes(b"line one\n\x00binary\xff tail\n")
    dest = tmp_path / "in-container" / "dest.conf"
    dest.parent.mkdir()
    p = adhoc(script, "ansible.builtin.copy", f"src={src} dest={dest} mode=0640")
    assert p.returncode == 0, p.stdout + p.stderr
    assert result(p)["changed"] is True
    assert dest.read_bytes() == src.read_bytes()
    assert oct(dest.stat().st_mode & 0o777) == "0o640"
    assert not any("mount" in c for c in calls(log)), "no container is mounted"

    log.unlink()
    again = adhoc(script, "ansible.builtin.copy", f"src={src} dest={dest} mode=0640")
    assert result(again)["changed"] is False
    # the action's temporary directory and its removal, the stat and the file module: the
    # modules themselves were sent on stdin, none was copied in and run from a file
    made = calls(log)
    assert len(made) <= 5, made
    assert not any("AnsiballZ" in " ".join(c) for c in made), made

    fetched = tmp_path / "fetched"
    p = adhoc(script, "ansible.builtin.fetch", f"src={dest} dest={fetched}/ flat=true")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (fetched / "dest.conf").read_bytes() == src.read_bytes()


def test_a_command_exit_code_and_a_missing_container(podman):
    script, _ = podman
    p = adhoc(script, "ansible.builtin.command", "sh -c 'echo out; exit 3'")
    r = result(p)
    assert p.returncode != 0 and r["rc"] == 3 and r["stdout"] == "out", r

    gone = adhoc(script, "ansible.builtin.ping", "", host="c3")
    assert gone.returncode != 0
    assert "no container with name or ID 'c3' found" in gone.stdout, gone.stdout


def test_an_async_task_delegated_from_the_control_node(podman, tmp_path):
    """rebuild-standby.yml's copy receiver: a play on localhost delegates an async task
    to the container. async is not pipelined: the wrapper and the module go in as files,
    the job runs on after its podman exec returns, and async_status reads its result.
    Every exec names the delegated container (ansible_host, which delegation sets), never
    the play's host: the connection once exec'd into a container named 'localhost'."""
    script, log = podman
    marker = tmp_path / "async-done"
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="json",
               ANSIBLE_ASYNC_DIR=str(tmp_path / "async"))
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"all": {"hosts": {"c1": {
        "ansible_connection": "shardfleet.fleet.podman",
        "ansible_podman_executable": str(script),
        "ansible_python_interpreter": sys.executable}}}}))
    play = tmp_path / "async.yml"
    play.write_text(f"""
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.command: sh -c 'sleep 1; echo done > {marker}; echo finished'
      delegate_to: c1
      async: 60
      poll: 0
      register: job
    - ansible.builtin.async_status:
        jid: "{{{{ job.ansible_job_id }}}}"
      delegate_to: c1
      register: st
      until: st.finished
      retries: 60
      delay: 1
""")
    p = subprocess.run(
        [str(ANSIBLE) + "-playbook", "-i", str(inventory), str(play)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    status = json.loads(p.stdout)["plays"][0]["tasks"][1]["hosts"]["localhost"]
    assert status["finished"] and status["stdout"] == "finished", status
    assert marker.read_text() == "done\n"
    made = calls(log)
    assert made and {c[c.index("exec") + 1 + (c[1] == "-i")] for c in made} == {"c1"}, made


def test_a_task_delegated_to_the_peer_runs_in_the_peer(podman, tmp_path):
    """The mysql role reads the peer's GTID position with a task delegated from one pair
    node to the other: it must run in the peer's container, not the play host's (where
    it would silently read the host's own position)."""
    script, log = podman
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    conn = {"ansible_connection": "shardfleet.fleet.podman",
            "ansible_podman_executable": str(script), "ansible_python_interpreter": sys.executable}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"all": {"hosts": {"c1": conn, "c2": conn}}}))
    play = tmp_path / "peer.yml"
    play.write_text("""
- hosts: c1
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo from the peer
      delegate_to: c2
      changed_when: false
""")
    p = subprocess.run([str(ANSIBLE) + "-playbook", "-i", str(inventory), str(play)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    made = calls(log)
    assert made and {c[c.index("exec") + 1 + (c[1] == "-i")] for c in made} == {"c2"}, made
