# Copyright: shardfleet contributors
# Apache License 2.0
"""The converged module's control-node half: the digest of a play's inputs for a host.

Everything a site.yml play reads goes into one SHA-256 (docs/roles.md, "What a rerun
checks"): the collection's own files, the inventory's files and the loaded inventory (a
dynamic one's hosts and groups too), this host's inventory variables as templated now,
the -e arguments, and the play's ``paths`` and ``inputs``. A change to any of them sends
the host down the play's full path. A secret (a variable named like one) enters as an
HMAC under a key kept on the control node (``SHARDFLEET_CONVERGED_KEY_FILE``, default
``~/.ansible/shardfleet/converged.key``, made 0600 on first use and never printed): a
rotation changes the digest, and the digest, which the host keeps and -vvv prints, is no
oracle for the value. The fast path's own switches (shardfleet_converged_*) are left out.

The digest is a host's *base* (all but ``inputs``) and then ``inputs``: a play that
changes an input it read (the shards play registering the first map) stamps its base with
the input as the play left it. The host's observed state is the module's half.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

import yaml  # Ansible's own dependency
from ansible import context
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase
from ansible.utils.vars import load_extra_vars
from ansible_collections.shardfleet.fleet.plugins.module_utils.observe import inputs_reason

DOCUMENTATION = ""  # the module's (plugins/modules/converged.py)

MODULE = "shardfleet.fleet.converged"
COLLECTION = Path(__file__).resolve().parents[2]
# what the collection is made of; the library (src/shardfleet) when the collection carries it
COLLECTION_PARTS = ("galaxy.yml", "roles", "playbooks", "plugins", "src/shardfleet")
SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache", ".mypy_cache", ".ruff_cache", "molecule"}
SECRET = re.compile(r"password|passwd|passphrase|secret|token|private|_key$|^vault_", re.I)
VARS_DIRS = ("group_vars", "host_vars")
OWN_SWITCHES = "shardfleet_converged_"


def files_under(path: Path) -> list[Path]:
    """``path`` itself, or every file below it (sorted; caches and bytecode left out)."""
    if path.is_file():
        return [path]
    found: list[Path] = []
    for top, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        found.extend(Path(top) / n for n in sorted(names) if not n.endswith(".pyc"))
    return found


def read_files(paths: list[Path]) -> list[tuple[Path, bytes | None]]:
    """Each file's bytes, None for one that cannot be read (read once: hashed, and the
    inventory's variable files parsed, from the same bytes)."""
    out: list[tuple[Path, bytes | None]] = []
    for p in paths:
        try:
            out.append((p, p.read_bytes()))
        except OSError:
            out.append((p, None))
    return out


def hash_files(h: Any, label: str, contents: list[tuple[Path, bytes | None]],
               base: Path | None = None) -> None:
    for p, data in contents:
        name = str(p.relative_to(base)) if base is not None else str(p)
        if data is None:
            data = b"<unreadable>"
        h.update(f"\0{label}\0{name}\0{len(data)}\0".encode())
        h.update(data)


def collection_files() -> list[Path]:
    return [f for part in COLLECTION_PARTS if (COLLECTION / part).exists()
            for f in files_under(COLLECTION / part)]


def inventory_files(sources: list[str], playbook_dir: str | None) -> list[Path]:
    """The inventory's files: a directory source whole; a file source with the
    group_vars/host_vars beside it; the playbook directory's group_vars/host_vars."""
    roots: list[Path] = []
    for source in sources:
        p = Path(source)
        if p.is_dir():
            roots.append(p)
        elif p.is_file():
            roots.append(p)
            roots.extend(p.parent / d for d in VARS_DIRS)
    if playbook_dir:
        roots.extend(Path(playbook_dir) / d for d in VARS_DIRS)
    seen: set[Path] = set()
    out: list[Path] = []
    for root in roots:
        if not root.exists():
            continue
        for f in files_under(root):
            if f not in seen:
                seen.add(f)
                out.append(f)
    return out


def key_file() -> Path:
    return Path(os.environ.get("SHARDFLEET_CONVERGED_KEY_FILE")
                or Path.home() / ".ansible" / "shardfleet" / "converged.key")


def secret_key() -> bytes:
    """The control node's key for the secrets' hashes: read, or made once (0600, created
    exclusively so two runs at once agree on one key)."""
    path = key_file()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def keyed(variables: dict, key: bytes) -> dict:
    """``variables`` without the fast path's own switches (a full run -e
    shardfleet_converged_fast_path=false stamps what the next plain run accepts), each
    secret replaced by its HMAC under *key*."""
    return {k: ("hmac:" + hmac.new(key, canonical(v).encode(), hashlib.sha256).hexdigest()
                if SECRET.search(str(k)) else v)
            for k, v in variables.items() if not str(k).startswith(OWN_SWITCHES)}


def canonical(data: object) -> str:
    # an object JSON cannot write (an encrypted value) counts by its type alone
    return json.dumps(data, sort_keys=True, separators=(",", ":"),
                      default=lambda o: f"<{type(o).__name__}>")


def final_digest(base: str, inputs: object) -> str:
    """A host's digest: its base (everything the play reads but ``inputs``) and the
    play's ``inputs``."""
    h = hashlib.sha256(base.encode())
    h.update(b"\0inputs\0")
    h.update(canonical(inputs).encode())
    return h.hexdigest()


def loaded_inventory(inventory: Any) -> str | None:
    """Every host's and group's variables as the inventory plugins loaded them (raw,
    not templated), and the membership: what a dynamic inventory adds to its files."""
    if inventory is None:
        return None
    hosts = {name: {"vars": dict(h.vars), "groups": sorted(g.name for g in h.get_groups())}
             for name, h in inventory.hosts.items()}
    groups = {name: {"vars": dict(g.vars), "children": sorted(c.name for c in g.child_groups)}
              for name, g in inventory.groups.items()}
    return canonical({"hosts": hosts, "groups": groups})


def file_var_names(files: list[tuple[Path, bytes | None]]) -> set[str]:
    """The top-level keys of the inventory's group_vars and host_vars files (parsed once
    for a play, whatever the number of its hosts)."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    names: set[str] = set()
    for f, raw in files:
        if raw is None or not any(part in VARS_DIRS for part in f.parts) \
                or f.suffix not in (".yml", ".yaml", ""):
            continue
        try:
            data = yaml.load(raw.decode(errors="replace"), Loader=Loader)  # noqa: S506 - safe loader subclass
        except yaml.YAMLError:
            continue  # a vault-encrypted file: its bytes are hashed
        if isinstance(data, dict):
            names.update(str(k) for k in data)
    return names


def var_names(file_names: set[str], inventory: Any, host: str) -> set[str]:
    """The names of the inventory's variables: those of its group_vars and host_vars files
    (*file_names*), and the host's and its groups' variables in the loaded inventory."""
    names = set(file_names)
    h = inventory.hosts.get(host) if inventory is not None else None
    if h is not None:
        names.update(h.vars)
        for g in h.get_groups():
            names.update(g.vars)
    return names


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("name", "state", "digest", "enabled", "observe", "paths",
                             "inputs", "max_age", "path", "base", "observed"))

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        host = str(task_vars.get("inventory_hostname", ""))
        base = ""
        if args.get("state", "check") == "present":
            narrowed = self._narrowed()
            if narrowed:
                result.update(changed=False, converged=False, digest=args.get("digest") or "",
                              reason="", drift=[], written=False,
                              msg=f"no stamp: the run is narrowed by {narrowed}, "
                                  "so the host is not known converged")
                return result
            if args.get("base"):
                # the check's base with the inputs as the play left them
                args["digest"] = final_digest(str(args["base"]), args.get("inputs"))
        elif args.get("state", "check") == "check":
            base = self._base(self._common(args, task_vars), args, host, task_vars)
            args["digest"] = final_digest(base, args.get("inputs"))
            observed = args.pop("observed", None)
            if isinstance(observed, dict):
                result.update(self._decide(args, observed, task_vars), base=base)
                return result
        # paths, inputs, base and observed are the control node's: not shipped
        for name in ("paths", "inputs", "base", "observed"):
            args.pop(name, None)
        result.update(self._execute_module(module_name=MODULE, module_args=args,
                                           task_vars=task_vars))
        if base:
            result["base"] = base
        return result

    def _decide(self, args: dict, observed: dict, task_vars: dict) -> dict:
        """The check against the host's stamps as this run's first play observed them
        (``state: observe``): on the control node, no call to the host unless a stamp
        that no longer holds is to be removed."""
        name = str(args.get("name"))
        play = observed.get(name)
        reason = inputs_reason(boolean(args.get("enabled", True), strict=False),
                               play.get("digest") if isinstance(play, dict) else None,
                               args["digest"])
        drift: list = []
        if not reason:
            reason, drift = str(play.get("reason") or ""), list(play.get("drift") or [])
        if reason and isinstance(play, dict):
            # a run that stops half-way leaves no stamp behind (check mode: the module
            # removes nothing)
            gone = self._execute_module(
                module_name=MODULE, task_vars=task_vars,
                module_args={"name": name, "state": "absent",
                             **({"path": args["path"]} if args.get("path") else {})})
            if gone.get("failed"):
                return dict(gone, converged=False, digest=args["digest"], reason=reason,
                            drift=drift, written=False)
        return dict(changed=False, converged=not reason, digest=args["digest"], reason=reason,
                    drift=drift, written=False)

    @staticmethod
    def _narrowed() -> str:
        cli = context.CLIARGS
        tags = [t for t in (cli.get("tags") or ()) if t != "all"]
        parts = (("--tags", tags), ("--skip-tags", list(cli.get("skip_tags") or ())),
                 ("--start-at-task", cli.get("start_at_task")), ("--step", cli.get("step")))
        return ", ".join(flag for flag, value in parts if value)

    def _common(self, args: dict, task_vars: dict) -> dict:
        """What every host's base shares: the collection's and the inventory's files,
        the loaded inventory, the -e arguments and the play's paths (hashed once however
        many hosts the digests are for), each part's own digest kept for
        SHARDFLEET_CONVERGED_DEBUG (with the inputs', which final_digest adds)."""
        parts: dict[str, str] = {}
        key = secret_key()

        def part(label: str, feed: Any) -> None:
            p = hashlib.sha256()
            feed(p)
            parts[label] = p.hexdigest()

        part("name", lambda p: p.update(canonical([
            str(args.get("name")),
            str(task_vars.get("ansible_version", {}).get("full", ""))]).encode()))
        part("collection",
             lambda p: hash_files(p, "collection", read_files(collection_files()), COLLECTION))
        inv_files = inventory_files(list(task_vars.get("ansible_inventory_sources") or []),
                                    task_vars.get("playbook_dir"))
        inv_contents = read_files(inv_files)
        part("inventory_files",
             lambda p: hash_files(p, "inventory", inv_contents))
        # the loaded inventory (HostVars keeps it; an inventory plugin's hosts are there only)
        inventory = getattr(task_vars.get("hostvars"), "_inventory", None)
        loaded = loaded_inventory(inventory)
        # an inventory this cannot read is never known converged
        part("loaded_inventory", lambda p: p.update(
            (loaded if loaded is not None else secrets.token_hex(16)).encode()))
        # the -e arguments as parsed (an @file's variables), untemplated
        part("extra_vars", lambda p: p.update(
            canonical(keyed(dict(load_extra_vars(self._loader)), key)).encode()))
        part("paths", lambda p: hash_files(
            p, "paths", read_files([Path(x) for x in args.get("paths") or []])))
        h = hashlib.sha256(b"shardfleet converged 3")
        h.update(canonical(parts).encode())
        part("inputs", lambda p: p.update(canonical(args.get("inputs")).encode()))
        return {"digest": h.hexdigest(), "file_names": file_var_names(inv_contents),
                "inventory": inventory, "key": key, "parts": parts}

    def _base(self, common: dict, args: dict, host: str, task_vars: dict) -> str:
        """*host*'s base: the common part and the host's inventory variables as templated
        now, each secret by its keyed hash."""
        h = hashlib.sha256(common["digest"].encode())
        h.update(canonical([host]).encode())
        templated = {}
        names = var_names(common["file_names"], common["inventory"], host)
        for name in sorted(names):
            if name.startswith(OWN_SWITCHES) or name not in task_vars:
                continue
            try:
                templated[name] = self._templar.template(task_vars[name])
            except Exception as e:  # noqa: BLE001 - undefined before facts: the same answer each run
                templated[name] = f"<{type(e).__name__}>"
        h.update(canonical(keyed(templated, common["key"])).encode())
        base = h.hexdigest()
        debug = os.environ.get("SHARDFLEET_CONVERGED_DEBUG")
        if debug:  # why a host took the full path: each part's digest, never a value
            line = {"name": str(args.get("name")), "host": host,
                    "digest": final_digest(base, args.get("inputs")), "base": base,
                    "parts": common["parts"],
                    "vars": {k: hashlib.sha256(canonical(v).encode()).hexdigest()[:16]
                             for k, v in keyed(templated, common["key"]).items()}}
            with open(debug, "a", encoding="utf-8") as f:
                f.write(json.dumps(line, sort_keys=True) + "\n")
        return base
