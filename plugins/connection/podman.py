# Copyright (c) shardfleet contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Tasks in the local fleet's podman containers, one ``podman exec`` a module."""

from __future__ import annotations

DOCUMENTATION = r"""
name: podman
short_description: Run tasks in existing podman containers, one podman exec per module
description:
  - Runs tasks in an existing podman container with C(podman exec), like
    C(containers.podman.podman), but pipelined. A module goes to the container's Python
    on standard input (C(podman exec -i)), so a task costs one podman call. The
    C(containers.podman.podman) connection needs four for the same task (a mount, a
    temporary directory, and an exec that runs the copied module, then removes it).
  - A file (M(ansible.builtin.template), M(ansible.builtin.copy)) goes through
    C(podman exec -i CONTAINER sh -c 'cat > PATH'), and comes back through C(cat). No
    container is mounted, so the connection works for rootless podman too.
  - The local fleet's inventory (C(inventories/local)) and the end-to-end tier use it.
    C(bench/site_time.sh) measures a C(site.yml) rerun with it.
author: shardfleet
version_added: "0.4.0"
options:
  remote_addr:
    description:
      - The name or ID of the container. The last of these variables that is set wins, so
        a delegated task reaches the delegated host (delegation sets its C(ansible_host)),
        not the play's host.
    default: inventory_hostname
    vars:
      - name: inventory_hostname
      - name: ansible_host
      - name: ansible_podman_host
  remote_user:
    description:
      - The user (name or UID) that runs commands in the container (C(podman exec --user)).
        Unset runs them as the container's default user.
    ini:
      - section: defaults
        key: remote_user
    env:
      - name: ANSIBLE_REMOTE_USER
    vars:
      - name: ansible_user
  podman_executable:
    description:
      - The podman command.
    default: podman
    vars:
      - name: ansible_podman_executable
    env:
      - name: ANSIBLE_PODMAN_EXECUTABLE
  podman_extra_args:
    description:
      - Extra arguments for every podman call, before its subcommand.
    default: ''
    ini:
      - section: defaults
        key: podman_extra_args
    vars:
      - name: ansible_podman_extra_args
    env:
      - name: ANSIBLE_PODMAN_EXTRA_ARGS
  pipelining:
    description:
      - Send modules on standard input instead of copying them into the container.
        On by default. C(podman exec) has no C(requiretty), and a become method still
        works as with any pipelined connection.
    default: true
    type: boolean
    env:
      - name: ANSIBLE_PIPELINING
    ini:
      - section: connection
        key: pipelining
    vars:
      - name: ansible_pipelining
"""

EXAMPLES = r"""
# inventories/local/group_vars/fleet/main.yml
ansible_connection: shardfleet.fleet.podman
ansible_python_interpreter: /usr/bin/python3
"""

import shlex
import shutil
import subprocess

from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.module_utils.common.text.converters import to_bytes, to_native
from ansible.plugins.connection import ConnectionBase, ensure_connect
from ansible.utils.display import Display

display = Display()


class Connection(ConnectionBase):
    """podman exec per command; modules and files on standard input."""

    transport = "shardfleet.fleet.podman"
    has_pipelining = True

    def _connect(self) -> Connection:
        super()._connect()
        self._connected = True
        return self

    def _podman(self, args: list[str], in_data: bytes | None = None) -> tuple[int, bytes, bytes]:
        executable = self.get_option("podman_executable")
        path = shutil.which(executable)
        if not path:
            raise AnsibleConnectionFailure(f"{executable}: command not found in PATH")
        cmd = [path, *shlex.split(self.get_option("podman_extra_args") or ""), *args]
        display.vvv(f"RUN {cmd}", host=self._container)
        p = subprocess.run(
            [to_bytes(a, errors="surrogate_or_strict") for a in cmd],
            input=in_data,
            stdin=None if in_data is not None else subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        return p.returncode, p.stdout, p.stderr

    @property
    def _container(self) -> str:
        return self.get_option("remote_addr")

    def _exec_args(self, stdin: bool) -> list[str]:
        args = ["exec"]
        if stdin:
            args.append("-i")
        user = self.get_option("remote_user")
        if user:
            args += ["--user", str(user)]
        return [*args, self._container]

    @ensure_connect
    def exec_command(self, cmd: str, in_data: bytes | None = None, sudoable: bool = True):
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        argv = shlex.split(to_native(cmd, errors="surrogate_or_strict"))
        return self._podman([*self._exec_args(in_data is not None), *argv], in_data)

    @ensure_connect
    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)
        display.vvv(f"PUT {in_path} TO {out_path}", host=self._container)
        try:
            with open(to_bytes(in_path, errors="surrogate_or_strict"), "rb") as f:
                data = f.read()
        except OSError as exc:
            raise AnsibleError(f"cannot read {in_path}: {exc}") from exc
        script = f"cat > {shlex.quote(out_path)}"
        rc, _, stderr = self._podman([*self._exec_args(True), "/bin/sh", "-c", script], data)
        if rc != 0:
            raise AnsibleError(f"copying {in_path} to {out_path} in container {self._container} "
                               f"failed (rc {rc}): {to_native(stderr).strip()}")

    @ensure_connect
    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)
        display.vvv(f"FETCH {in_path} TO {out_path}", host=self._container)
        rc, stdout, stderr = self._podman([*self._exec_args(False), "cat", "--", in_path])
        if rc != 0:
            raise AnsibleError(f"fetching {in_path} from container {self._container} "
                               f"failed (rc {rc}): {to_native(stderr).strip()}")
        with open(to_bytes(out_path, errors="surrogate_or_strict"), "wb") as f:
            f.write(stdout)

    def close(self) -> None:
        super().close()
        self._connected = False
