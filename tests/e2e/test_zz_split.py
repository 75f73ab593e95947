"""split.yml on the e2e fleet: two more containers (pair003) get the mysql role, then
pair001's upper half moves onto them; a rerun changes nothing. (Runs after the site tests:
it changes the map.)"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import BIN, NET_TO, PREFIX_TO, REPO, Fleet

pytestmark = pytest.mark.e2e
NEW = {f"{PREFIX_TO}mysql003a": ("a", f"{NET_TO}61"), f"{PREFIX_TO}mysql003b": ("b", f"{NET_TO}62")}


def _inventory_with_pair003(fleet: Fleet, dest: Path) -> Path:
    text = (fleet.inventory / "hosts.yml").read_text()
    inv = yaml.safe_load(text)
    mysql = inv["all"]["children"]["fleet"]["children"]["mysql"]["hosts"]
    for host, (side, ip) in NEW.items():
        mysql[host] = {"shardfleet_pair": "pair003", "shardfleet_side": side,
                       "shardfleet_container_ip": ip}
    import shutil

    shutil.copytree(fleet.inventory, dest)
    (dest / "hosts.yml").write_text(yaml.safe_dump(inv))
    return dest


def _play(fleet: Fleet, inventory: Path, playbook: Path, *args: str) -> tuple[int, str, float]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    t0 = time.monotonic()
    p = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inventory), "-e",
                        f"@{fleet.extra_vars}", str(playbook), *args], cwd=REPO, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                       check=False)
    return p.returncode, p.stdout, time.monotonic() - t0


def test_split_moves_half_of_pair001_onto_a_new_pair(fleet: Fleet, tmp_path: Path) -> None:
    assert fleet.runs["site-fresh"].rc == 0, "site.yml failed; nothing to split"
    inv = _inventory_with_pair003(fleet, tmp_path / "inventory")
    try:
        rc, out, t_up = _play(fleet, inv, REPO / "playbooks" / "fleet-up.yml")
        assert rc == 0, f"fleet-up for pair003 failed:\n{out[-3000:]}"
        pb = tmp_path / "pair003.yml"
        pb.write_text(yaml.safe_dump([{
            "name": "MySQL pair003 (the split's target)", "hosts": ",".join(NEW),
            "become": False, "gather_subset": ["network"], "roles": [{"role": "mysql"}]}]))
        rc, out, t_mysql = _play(fleet, inv, pb)
        assert rc == 0, f"the mysql role on pair003 failed:\n{out[-3000:]}"
        rc, out, _ = _play(fleet, inv, REPO / "playbooks" / "split.yml", "--check",
                           "-e", "split_source_pair=pair001", "-e", "split_target_pair=pair003")
        assert rc == 0, f"split.yml --check failed:\n{out[-3000:]}"
        rc, out, t_split = _play(fleet, inv, REPO / "playbooks" / "split.yml",
                                 "-e", "split_source_pair=pair001",
                                 "-e", "split_target_pair=pair003")
        assert rc == 0, f"split.yml failed:\n{out[-4000:]}"
        assert "write_stall_seconds" in out
        rc, again, _ = _play(fleet, inv, REPO / "playbooks" / "split.yml",
                             "-e", "split_source_pair=pair001",
                             "-e", "split_target_pair=pair003")
        assert rc == 0 and "changed=0" in again.split("PLAY RECAP")[-1], again[-3000:]
        print(f"\ne2e split: pair003 up {t_up:.0f}s, mysql role {t_mysql:.0f}s, "
              f"split.yml {t_split:.0f}s")
        from shardfleet.mapstore import ZooKeeperMapStore

        zk = ",".join(f"{fleet.ip(h)}:2181" for h in fleet.group("zookeeper"))
        store = ZooKeeperMapStore(zk, "default")
        try:
            m = store.read().map
        finally:
            store.close()
        assert m is not None
        moved = m.range_for(2047)
        assert moved.master == f"{NEW[f'{PREFIX_TO}mysql003a'][1]}:3306", json.dumps(m.to_dict())
        assert moved.state == "open" and m.range_for(0).master != moved.master
    finally:
        subprocess.run(["podman", "rm", "-f", *NEW], check=False, capture_output=True)
