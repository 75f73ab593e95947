"""Throwaway certificates for the TLS tests (openssl): a CA (``ca``), another CA
(``other``), the server certificates ``server`` (IP SAN 127.0.0.1) and ``wrongname``
(DNS wrong.example), and a client certificate for the X509 account."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

X509_USER = "sf_x509"


def _openssl(cwd: Path, *args: str) -> None:
    p = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"openssl {args[0]}: {p.stderr}"


def _signed(d: Path, ca: str, name: str, subject: str, san: str | None, usage: str) -> None:
    """``name.key`` and ``name.pem``: a certificate signed by the CA *ca* (``ca.pem``)."""
    _openssl(d, "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-subj", f"/CN={subject}", "-out", f"{name}.csr")
    ext = [f"extendedKeyUsage={usage}", "basicConstraints=CA:FALSE"]
    if san:
        ext.append(f"subjectAltName={san}")
    (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey",
             f"{ca}.key", "-CAcreateserial", "-days", "2", "-sha256", "-extfile",
             f"{name}.ext", "-out", f"{name}.pem")


def _ca(d: Path, name: str) -> None:
    _openssl(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-sha256",
             "-subj", f"/CN=shardfleet test {name}", "-keyout", f"{name}.key",
             "-out", f"{name}.pem", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    """A throwaway CA (``ca``), another CA (``other``), the server certificates ``server``
    (IP SAN 127.0.0.1) and ``wrongname`` (DNS wrong.example), and a client certificate."""
    d = tmp_path_factory.mktemp("tls")
    _ca(d, "ca")
    _ca(d, "other")
    _signed(d, "ca", "server", "127.0.0.1", "IP:127.0.0.1", "serverAuth")
    _signed(d, "ca", "wrongname", "wrong.example", "DNS:wrong.example", "serverAuth")
    _signed(d, "ca", "client", X509_USER, None, "clientAuth")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return d


