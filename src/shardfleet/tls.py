"""TLS for the library's MySQL connections: the one place that turns the four client
options (community.mysql's names) into PyMySQL's ``ssl`` argument and into the
``[client]`` option-file lines of the MariaDB tools (``mariadb-dump``, ``mariadb``).

* ``ca_cert`` — a PEM file of the CA(s) that signed the servers' certificates. Given, the
  server's chain is verified against it (and nothing else).
* ``client_cert`` / ``client_key`` — a certificate (and its key, unless the certificate
  file holds it) presented to the server, for accounts created ``REQUIRE X509``.
* ``check_hostname`` — verify that the server's certificate names the address connected
  to (a DNS name, or an IP address as an IP SAN). Unset (None) it is on when ``ca_cert``
  is given, as with community.mysql on PyMySQL; ``True`` without ``ca_cert`` verifies
  against the system's CAs; ``False`` keeps the chain check of a given ``ca_cert``.

TLS is off unless one of them is given: the connection is then plain TCP, whatever the
PyMySQL release would do by default (1.1 plain, 1.2 "preferred", an unverified attempt),
so a fleet knows which it runs. On, it is required: a server that does not offer TLS is
refused before the credential is sent (PyMySQL 1.2) or, with PyMySQL 1.1, which falls
back silently, right after (:meth:`TLS.check`). Unix-socket connections stay plain: they
are local, and MariaDB counts them as secure transport.

A production fleet sets ``ca_cert`` (its own CA) and leaves ``check_hostname`` on, with
server certificates naming the addresses clients use (``host:port`` in the shard map).
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from typing import Any

from shardfleet.errors import DatabaseError, InvalidInputError


@dataclass(frozen=True)
class TLS:
    """The client TLS options of MySQL connections (module docstring); ``TLS()`` is off."""

    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    check_hostname: bool | None = None

    def __post_init__(self) -> None:
        if self.client_key and not self.client_cert:
            raise InvalidInputError("client_key is given without client_cert")

    @property
    def enabled(self) -> bool:
        return bool(self.ca_cert or self.client_cert or self.client_key
                    or self.check_hostname is not None)

    @property
    def verifies_name(self) -> bool:
        return bool(self.check_hostname) or (bool(self.ca_cert) and self.check_hostname is None)

    @functools.cached_property
    def context(self) -> ssl.SSLContext:
        """The client context (made once; raises InvalidInputError naming a bad file)."""
        _readable(self, "TLS option", ("ca_cert", "client_cert", "client_key"))
        try:
            ctx = ssl.create_default_context(cafile=self.ca_cert or None)
        except ssl.SSLError as exc:
            raise InvalidInputError(f"TLS option ca_cert: {self.ca_cert}: {exc}") from None
        # as PyMySQL does: certificates made by MariaDB's and older tools lack some
        # extensions Python 3.13 insists on by default
        ctx.verify_flags &= ~getattr(ssl, "VERIFY_X509_STRICT", 0)
        ctx.check_hostname = self.verifies_name
        if not self.ca_cert and not self.check_hostname:
            ctx.verify_mode = ssl.CERT_NONE  # encrypted, the server not verified
        if self.client_cert:
            try:
                ctx.load_cert_chain(self.client_cert, self.client_key or None)
            except ssl.SSLError as exc:
                raise InvalidInputError(f"TLS options client_cert/client_key: "
                                        f"{self.client_cert}: {exc}") from None
        return ctx

    def pymysql_kwargs(self) -> dict[str, Any]:
        """PyMySQL's ``ssl`` arguments: the context, or TLS disabled."""
        return {"ssl": self.context} if self.enabled else {"ssl_disabled": True}

    def check(self, conn: Any, where: str) -> None:
        """Refuse (close, DatabaseError) a connection that TLS was asked for and that is
        not encrypted: PyMySQL 1.1 goes on in plain text when the server offers no TLS."""
        if self.enabled and not isinstance(getattr(conn, "_sock", None), ssl.SSLSocket):
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
            raise DatabaseError(f"{where}: TLS was asked for and the server does not offer it")

    def option_lines(self) -> str:
        """``[client]`` option-file lines for the MariaDB tools (empty when off).

        The tools (MariaDB 10.11's client library) verify a certificate only with
        ``ssl-verify-server-cert``, which checks the chain and the name together: with
        ``check_hostname: false`` they encrypt without verifying the server."""
        if not self.enabled:
            return ""
        lines = ["ssl"]
        if self.ca_cert:
            lines.append(f"ssl-ca={self.ca_cert}")
        if self.client_cert:
            lines.append(f"ssl-cert={self.client_cert}")
        if self.client_key:
            lines.append(f"ssl-key={self.client_key}")
        if self.verifies_name:
            lines.append("ssl-verify-server-cert")
        return "".join(f"{line}\n" for line in lines)


OFF = TLS()


def _readable(opts: Any, what: str, options: tuple[str, ...], *, required: bool = False) -> None:
    """Raise InvalidInputError naming the first of *options* (paths, attributes of *opts*)
    that cannot be read (or, *required*, is not given)."""
    for option in options:
        path = getattr(opts, option)
        if not path:
            if required:
                raise InvalidInputError(f"{what} {option} is not given")
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise InvalidInputError(f"{what} {option}: cannot read {path}: "
                                    f"{exc.strerror}") from None


@dataclass(frozen=True)
class StreamTLS:
    """TLS of the physical copy stream (:mod:`shardfleet.physical`) between two fleet
    hosts, with the files the ``tls_cert`` role gives each MySQL host: the receiver shows
    its certificate (*cert*, *key*); the sender and a status client check it against the
    fleet's CA (*ca_cert*) and the receiver's address (an IP SAN). The copy's secret
    still decides who may send; TLS keeps the data and the receiver's identity safe on
    the wire."""

    ca_cert: str
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_dir(cls, directory: str) -> StreamTLS:
        """The tls_cert role's layout: ``ca.pem``, ``server.pem``, ``server.key``."""
        d = directory.rstrip("/")
        return cls(f"{d}/ca.pem", f"{d}/server.pem", f"{d}/server.key")

    @functools.cached_property
    def server_context(self) -> ssl.SSLContext:
        """The receiver's context (its certificate; no client certificate asked)."""
        _readable(self, "copy TLS", ("cert", "key"), required=True)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(str(self.cert), self.key or None)
        except ssl.SSLError as exc:
            raise InvalidInputError(f"copy TLS cert/key: {self.cert}: {exc}") from None
        return ctx

    @functools.cached_property
    def client_context(self) -> ssl.SSLContext:
        """The sender's and status client's context: the receiver verified, name too."""
        _readable(self, "copy TLS", ("ca_cert",), required=True)
        try:
            ctx = ssl.create_default_context(cafile=self.ca_cert)
        except ssl.SSLError as exc:
            raise InvalidInputError(f"copy TLS ca_cert: {self.ca_cert}: {exc}") from None
        ctx.verify_flags &= ~getattr(ssl, "VERIFY_X509_STRICT", 0)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx
