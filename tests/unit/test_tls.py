"""shardfleet.tls: the one place the client TLS options become PyMySQL's arguments and the
MariaDB tools' option-file lines (the connections themselves: tests/integration/test_tls.py)."""

from __future__ import annotations

import ssl

import pytest

from shardfleet import physical
from shardfleet.errors import InvalidInputError
from shardfleet.tls import TLS


def test_off_unless_given_and_then_explicitly_plain():
    assert not TLS().enabled
    # PyMySQL 1.2 would otherwise try an unverified TLS handshake, 1.1 would not
    assert TLS().pymysql_kwargs() == {"ssl_disabled": True}
    assert TLS().option_lines() == ""
    assert TLS(check_hostname=False).enabled


def test_ca_cert_verifies_the_chain_and_the_name_unless_check_hostname_is_false():
    ca = ssl.get_default_verify_paths().cafile or None
    if ca is None:
        pytest.skip("no system CA bundle to stand in for a CA file")
    ctx = TLS(ca_cert=ca).context
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    ctx = TLS(ca_cert=ca, check_hostname=False).context
    assert ctx.verify_mode == ssl.CERT_REQUIRED and not ctx.check_hostname
    tls = TLS(ca_cert=ca)
    assert tls.pymysql_kwargs() == {"ssl": tls.context}
    ctx = TLS(check_hostname=True).context  # the system's CAs
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    ctx = TLS(check_hostname=False).context  # encrypted, not verified
    assert ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname


def test_bad_options_are_refused_naming_the_option_and_the_file(tmp_path):
    with pytest.raises(InvalidInputError, match="client_key is given without client_cert"):
        TLS(client_key="/k.pem")
    with pytest.raises(InvalidInputError, match=r"ca_cert: cannot read .*nope\.pem"):
        TLS(ca_cert=str(tmp_path / "nope.pem")).context  # noqa: B018
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(InvalidInputError, match="ca_cert"):
        TLS(ca_cert=str(junk)).context  # noqa: B018


def test_the_tools_option_file_carries_the_same_options(tmp_path):
    tls = TLS(ca_cert="/etc/sf/ca.pem", client_cert="/etc/sf/c.pem", client_key="/etc/sf/c.key")
    path = physical.client_defaults(str(tmp_path), "admin", "pw", tls)
    text = open(path).read()
    assert text.splitlines()[3:] == ["ssl", "ssl-ca=/etc/sf/ca.pem", "ssl-cert=/etc/sf/c.pem",
                                     "ssl-key=/etc/sf/c.key", "ssl-verify-server-cert"]
    assert "ssl-verify-server-cert" not in TLS(ca_cert="/c", check_hostname=False).option_lines()
