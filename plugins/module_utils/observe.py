# Copyright: shardfleet contributors
# Apache License 2.0
"""What a host looks like, in the parts a site.yml play manages (the converged module's
observed state, docs/roles.md "What a rerun checks").

``observe(spec)`` returns ``{part: value}``, one short digest (or a plain word) per part,
comparable across runs and never holding a secret's value. A play's stamp records the
spec and the parts as the play left the host; the next run's check observes the same
spec and names every part that differs. The spec's kinds:

* ``files``: paths (a directory: every file below it): content, mode, owner, group;
* ``services``: systemd units: active and enabled;
* ``packages``: Debian packages: installed version;
* ``mariadb``: over the server's unix socket as the module's user (root):
  ``users`` (their mysql.global_priv rows: privileges and password hash),
  ``variables_from`` (option files: the global variables they set, less ``exclude``),
  ``replication`` (each channel's source and whether it runs), ``read_only``,
  ``db_grants`` (mysql.db rows of these users), ``databases`` (the names of the schemas
  LIKE this pattern);
* ``redis``: ``conf``: CONFIG GET of every directive the file sets (redis-cli, with the
  file's own address, port, CA and password);
* ``memcached``: ``address``/``port``: ``stats settings``.

A part that cannot be read is ``error:<what>``, which never counts as converged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import stat
import subprocess

ERROR = "error:"


def _digest(data):
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _file_entry(path):
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        body = "link:" + os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        body = h.hexdigest()
    else:
        body = "dir" if stat.S_ISDIR(st.st_mode) else "special"
    return [body, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid]


def observe_path(path):
    """A file's (or a directory tree's) content, modes and owners; ``absent`` when it is not
    there."""
    if not os.path.lexists(path):
        return "absent"
    entries = {".": _file_entry(path)}
    if os.path.isdir(path) and not os.path.islink(path):
        for top, dirs, names in os.walk(path):
            dirs.sort()
            for n in sorted(dirs + names):
                full = os.path.join(top, n)
                entries[os.path.relpath(full, path)] = _file_entry(full)
    return _digest(entries)


def _run(argv, env=None, timeout=30):
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env=env, timeout=timeout, check=False)
    return proc.returncode, proc.stdout


def observe_services(units):
    if not units:
        return {}
    _, active = _run(["systemctl", "is-active", *units])
    _, enabled = _run(["systemctl", "is-enabled", *units])
    a, e = active.split(), enabled.split()
    out = {}
    for i, u in enumerate(units):
        out["service:" + u] = (f"{a[i] if i < len(a) else 'unknown'} "
                               f"{e[i] if i < len(e) else 'unknown'}")
    return out


def observe_packages(names):
    if not names:
        return {}
    _, text = _run(["dpkg-query", "-W", "-f=${Package} ${Version} ${db:Status-Abbrev}\n", *names])
    seen = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2].startswith("ii"):
            seen[parts[0]] = parts[1]
    return {"package:" + n: seen.get(n, "absent") for n in names}


def option_names(paths):
    """The option names an option file sets (MySQL's format: ``name = value`` or ``name``,
    ``-`` and ``_`` alike), in the server's sections."""
    names = set()
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        section = ""
        for line in lines:
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]").strip().lower()
                continue
            if section in ("mysqld", "mariadb", "server", "mariadbd"):
                names.add(re.split(r"[\s=]", line, maxsplit=1)[0].replace("-", "_").lower())
    return sorted(names)


def _mariadb_parts(cur, spec):
    out = {}

    def rows(sql, args=None):
        cur.execute(sql, args)
        return [list(r) for r in cur.fetchall()]

    users = spec.get("users") or []
    if users:
        marks = ",".join(["%s"] * len(users))
        out["mariadb:users"] = _digest(rows(
            f"SELECT User, Host, Priv FROM mysql.global_priv WHERE User IN ({marks}) "
            "ORDER BY User, Host", users))
    if spec.get("variables_from"):
        names = [n for n in option_names(spec["variables_from"])
                 if n not in set(spec.get("exclude") or [])]
        got = {r[0].lower(): r[1] for r in rows("SHOW GLOBAL VARIABLES")}
        out["mariadb:variables"] = _digest({n: got[n] for n in names if n in got})
    if spec.get("replication"):
        cur.execute("SHOW ALL SLAVES STATUS")
        cols = [d[0] for d in cur.description or []]
        channels = []
        for r in cur.fetchall():
            row = dict(zip(cols, r, strict=True))
            channels.append([row.get("Connection_name"), row.get("Master_Host"),
                             row.get("Master_Port"), row.get("Master_User"),
                             row.get("Master_SSL_Allowed"),
                             row.get("Slave_IO_Running") != "No",  # Connecting counts as running
                             row.get("Slave_SQL_Running") == "Yes"])
        out["mariadb:replication"] = _digest(sorted(channels, key=str))
    if spec.get("read_only"):
        out["mariadb:read_only"] = str(rows("SELECT @@GLOBAL.read_only")[0][0])
    grants = spec.get("db_grants") or []
    if grants:
        marks = ",".join(["%s"] * len(grants))
        out["mariadb:db_grants"] = _digest(rows(
            f"SELECT * FROM mysql.db WHERE User IN ({marks}) ORDER BY Host, Db, User", grants))
    if spec.get("databases"):
        out["mariadb:databases"] = _digest(rows(
            "SELECT SCHEMA_NAME FROM information_schema.SCHEMATA WHERE SCHEMA_NAME LIKE %s "
            "ORDER BY SCHEMA_NAME", [str(spec["databases"])]))
    return out


def observe_mariadb(spec):
    try:
        import pymysql  # the role installs it (community.mysql needs it too)

        conn = pymysql.connect(unix_socket=spec.get("socket") or "/run/mysqld/mysqld.sock",
                               user="root", connect_timeout=10, read_timeout=30)
    except Exception as e:  # noqa: BLE001 - any failure is the answer
        return {"mariadb:server": ERROR + type(e).__name__}
    try:
        with conn.cursor() as cur:
            return _mariadb_parts(cur, spec)
    except Exception as e:  # noqa: BLE001
        return {"mariadb:server": ERROR + type(e).__name__}
    finally:
        conn.close()


def redis_settings(conf):
    """The directives a redis.conf sets, and how redis-cli reaches the server it
    configures (address, port, TLS, password), read from the file itself."""
    directives, cfg = [], {}
    with open(conf, encoding="utf-8", errors="replace") as f:
        for line in f:
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            name = words[0].lower()
            cfg[name] = words[1:]
            if name not in ("requirepass", "include", "rename-command", "user"):
                directives.append(name)
    return sorted(set(directives)), cfg


def observe_redis(spec):
    try:
        names, cfg = redis_settings(spec["conf"])
    except OSError:
        return {"redis:config": "absent"}
    tls_port = (cfg.get("tls-port") or ["0"])[0]
    tls = tls_port not in ("0", "")
    port = tls_port if tls else (cfg.get("port") or ["6379"])[0]
    host = (cfg.get("bind") or ["127.0.0.1"])[0].lstrip("-")
    argv = [spec.get("cli") or "redis-cli", "--no-auth-warning", "-h", host, "-p", port]
    if tls:
        argv += ["--tls", "--cacert", (cfg.get("tls-ca-cert-file") or [""])[0]]
    env = dict(os.environ)
    if cfg.get("requirepass"):
        env["REDISCLI_AUTH"] = cfg["requirepass"][0]
    try:
        rc, text = _run([*argv, "CONFIG", "GET", *names], env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"redis:config": ERROR + type(e).__name__}
    lines = text.splitlines()
    if rc != 0 or not lines or len(lines) % 2:
        return {"redis:config": ERROR + "CONFIG GET"}
    return {"redis:config": _digest(sorted(zip(lines[::2], lines[1::2], strict=True)))}


def observe_memcached(spec):
    try:
        with socket.create_connection((spec["address"], int(spec["port"])), timeout=10) as s:
            s.sendall(b"stats settings\r\n")
            data = b""
            for _ in range(200):  # bounded: the answer is a few kB
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                if data.endswith(b"END\r\n"):
                    break
    except (OSError, ValueError) as e:
        return {"memcached:settings": ERROR + type(e).__name__}
    lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.startswith("STAT ")]
    if not lines:
        return {"memcached:settings": ERROR + "stats settings"}
    return {"memcached:settings": _digest(sorted(lines))}


def observe(spec):
    """Every part ``spec`` names, as this host has it now."""
    spec = spec or {}
    out = {}
    for path in spec.get("files") or []:
        try:
            out["file:" + path] = observe_path(path)
        except OSError as e:
            out["file:" + path] = ERROR + type(e).__name__
    out.update(observe_services(list(spec.get("services") or [])))
    out.update(observe_packages(list(spec.get("packages") or [])))
    if spec.get("mariadb"):
        out.update(observe_mariadb(spec["mariadb"]))
    if spec.get("redis"):
        out.update(observe_redis(spec["redis"]))
    if spec.get("memcached"):
        out.update(observe_memcached(spec["memcached"]))
    return out


DISABLED = "disabled (shardfleet_converged_fast_path=false, or the play allows none yet)"


def inputs_reason(enabled, recorded_digest, digest):
    """The first reasons a stamp does not hold, before its observed state is looked at:
    the fast path off, no stamp (``recorded_digest`` None), other inputs. Empty: none."""
    if not enabled:
        return DISABLED
    if recorded_digest is None:
        return "no stamp"
    if recorded_digest != digest:
        return "inputs changed"
    return ""


def differences(recorded, now):
    """The parts whose value differs between the stamp's ``recorded`` and ``now``, or that
    cannot be read now (sorted)."""
    keys = set(recorded) | set(now)
    return sorted(k for k in keys
                  if recorded.get(k) != now.get(k) or str(now.get(k, "")).startswith(ERROR))
