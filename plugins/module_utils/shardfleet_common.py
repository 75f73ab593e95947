# Shared plumbing of the shardfleet modules: argument specs, the library import,
# and connections. The modules are thin adapters: the work is in the library.

from __future__ import annotations

import subprocess
import traceback
from contextlib import contextmanager

from ansible.module_utils.basic import missing_required_lib

try:
    import shardfleet  # noqa: F401
    from shardfleet.errors import ShardfleetError

    HAS_SHARDFLEET = True
    SHARDFLEET_IMPORT_ERROR = None
except ImportError:  # pragma: no cover - reported by require_library()
    HAS_SHARDFLEET = False
    SHARDFLEET_IMPORT_ERROR = traceback.format_exc()

    class ShardfleetError(Exception):  # type: ignore[no-redef]
        pass


def mysql_argument_spec():
    return dict(
        login_host=dict(type="str", default="127.0.0.1"),
        login_port=dict(type="int", default=3306),
        login_user=dict(type="str", default="shardfleet_admin"),
        login_password=dict(type="str", default="", no_log=True),
        login_unix_socket=dict(type="str"),
        connect_timeout=dict(type="float", default=10),
        **mysql_tls_argument_spec(),
    )


def mysql_tls_argument_spec():
    """The client TLS options (community.mysql's names), documented by the doc fragment
    ``shardfleet.fleet.mysql.tls`` (in ``shardfleet.fleet.mysql`` too). Paths, not
    secrets: the key file's content never passes through the module."""
    return dict(
        ca_cert=dict(type="path", aliases=["ssl_ca"]),
        client_cert=dict(type="path", aliases=["ssl_cert"]),
        client_key=dict(type="path", aliases=["ssl_key"], no_log=False),
        check_hostname=dict(type="bool"),
    )


def mysql_tls(module):
    """The library's TLS options from the module's (fail_json on a bad combination or an
    unreadable certificate file)."""
    from shardfleet.tls import TLS

    p = module.params
    with library_errors(module, "TLS options"):
        tls = TLS(ca_cert=p.get("ca_cert"), client_cert=p.get("client_cert"),
                  client_key=p.get("client_key"), check_hostname=p.get("check_hostname"))
        if tls.enabled:
            tls.context  # noqa: B018 - a bad file fails here, named, before any login
    return tls


def zookeeper_argument_spec():
    return dict(
        zookeeper_hosts=dict(type="list", elements="str", required=True),
        zookeeper_root=dict(type="str", default="/shardfleet"),
        cluster=dict(type="str", default="default"),
        zookeeper_user=dict(type="str"),
        zookeeper_password=dict(type="str", no_log=True),
        zookeeper_timeout=dict(type="float", default=10),
    )


def require_library(module):
    if not HAS_SHARDFLEET:
        module.fail_json(msg=missing_required_lib("shardfleet"),
                         exception=SHARDFLEET_IMPORT_ERROR)


def service_action(module, verb):
    """A callable running ``systemctl VERB`` on the module's ``service`` option (the
    stop/start a data directory swap needs); an OSError naming the unit on failure."""
    def run():
        r = subprocess.run(["systemctl", verb, module.params["service"]], capture_output=True,
                           text=True, check=False)
        if r.returncode:
            raise OSError(f"systemctl {verb} {module.params['service']}: {r.stderr.strip()}")
    return run


def mysql_connect(module, **kw):
    """An admin connection from the login options; fail_json with one line on error."""
    from shardfleet import topology

    p = module.params
    with library_errors(module, f"{p['login_host']}:{p['login_port']}"):
        return topology.connect(f"{p['login_host']}:{p['login_port']}", p["login_user"],
                                p["login_password"], timeout=p["connect_timeout"],
                                unix_socket=p["login_unix_socket"], tls=mysql_tls(module),
                                **kw)


def zookeeper_hosts(module):
    """The ensemble of the ZooKeeper options as one connect string."""
    return ",".join(h.strip() for h in module.params["zookeeper_hosts"] for h in h.split(",")
                    if h.strip())


def open_zookeeper_store(module):
    """A map store from the ZooKeeper options, connected or not (``store.connected``);
    raises what the client raises."""
    from shardfleet.mapstore import ZooKeeperMapStore

    p = module.params
    auth = None
    if p.get("zookeeper_user"):
        auth = (p["zookeeper_user"], p.get("zookeeper_password") or "")
    return ZooKeeperMapStore(zookeeper_hosts(module), p["cluster"], root=p["zookeeper_root"],
                             auth=auth, timeout=p["zookeeper_timeout"])


def zookeeper_store(module):
    """A map store from the ZooKeeper options; fail_json when it cannot connect."""
    p = module.params
    hosts = zookeeper_hosts(module)
    with library_errors(module, f"ZooKeeper at {hosts}"):
        store = open_zookeeper_store(module)
    if not store.connected:
        store.close(timeout=1)
        module.fail_json(msg=f"ZooKeeper at {hosts} is unreachable "
                             f"(no answer within {p['zookeeper_timeout']}s)")
    return store


def _one_line(exc):
    """One line for any error: the MySQL error number when there is one, the ZooKeeper
    error's class when kazoo gives no text (many of its errors have none)."""
    text = " ".join(str(exc).split())
    cls = type(exc).__name__
    mod = type(exc).__module__ or ""
    if mod.startswith("pymysql"):
        args = getattr(exc, "args", ())
        if len(args) > 1 and isinstance(args[0], int):
            return f"MySQL error {args[0]}: {' '.join(str(args[1]).split())}"
        return f"MySQL: {text or cls}"
    if mod.startswith("kazoo"):
        return f"ZooKeeper: {cls}{(': ' + text) if text else ''}"
    if isinstance(exc, ShardfleetError):
        return text or cls
    return f"{cls}: {text}" if text else cls


def _scrub(module, text):
    """Every no_log value (passwords) out of *text*, whatever Ansible's version does."""
    for secret in sorted(getattr(module, "no_log_values", ()) or (), key=len, reverse=True):
        if secret and len(str(secret)) > 2:
            text = text.replace(str(secret), "********")
    return text


@contextmanager
def library_errors(module, what="", result=None):
    """The modules' one error boundary around their library call.

    Any failure (the library's ShardfleetError, a PyMySQL or kazoo error, an OSError, a
    bug) becomes one fail_json: a one-line ``msg`` (prefixed with *what*), the traceback
    as ``exception`` (shown with -vvv, as Ansible does for its own modules), *result*'s
    keys (what was done before the failure), and no secret in either. fail_json itself
    (SystemExit) passes through.
    """
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - this is the boundary
        msg = _one_line(exc)
        if what and not isinstance(exc, ShardfleetError):  # the library's say where already
            msg = f"{what}: {msg}"
        module.fail_json(msg=_scrub(module, msg),
                         exception=_scrub(module, traceback.format_exc()),
                         **(result or {}))
