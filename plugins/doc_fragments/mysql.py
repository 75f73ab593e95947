# MySQL connection options shared by the shardfleet modules
# (extends_documentation_fragment: shardfleet.fleet.mysql; the TLS options alone:
# shardfleet.fleet.mysql.tls).


# The client TLS options: in DOCUMENTATION with the login options, and alone in TLS for
# the modules that declare their own login options.
_TLS_OPTIONS = r"""
  ca_cert:
    description:
      - A PEM file of the CA certificate(s) that signed the servers' certificates. Given,
        the connection uses TLS and the server's certificate chain is verified against it.
      - TLS is off unless one of I(ca_cert), I(client_cert), I(client_key) or
        I(check_hostname) is given; then it is required (a server that does not offer TLS
        is refused). A connection through I(login_unix_socket) stays plain (local).
      - A production fleet sets this (its own CA) and leaves I(check_hostname) on. The
        C(mysql) role does not yet install server certificates; give the servers
        C(ssl_ca), C(ssl_cert), C(ssl_key) (and C(require_secure_transport)) yourself.
    type: path
    aliases: [ssl_ca]
  client_cert:
    description:
      - A client certificate (PEM) presented to the server, for an account created
        C(REQUIRE X509) (or C(REQUIRE SUBJECT)/C(ISSUER)).
    type: path
    aliases: [ssl_cert]
  client_key:
    description:
      - The key of I(client_cert), unless that file holds it. A path; the key itself never
        passes through the module.
    type: path
    aliases: [ssl_key]
  check_hostname:
    description:
      - Verify that the server's certificate names the address connected to (a DNS name,
        or an IP address as an IP subject alternative name).
      - Unset, it is on when I(ca_cert) is given (community.mysql's behaviour with
        PyMySQL). C(true) without I(ca_cert) verifies against the system's CAs. C(false)
        keeps the chain check of I(ca_cert) and skips the name only.
    type: bool
"""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  login_host:
    description: MySQL server to connect to.
    type: str
    default: 127.0.0.1
  login_port:
    description: Its TCP port.
    type: int
    default: 3306
  login_user:
    description: An administrative user (the C(mysql) role's C(mysql_admin_user)).
    type: str
    default: shardfleet_admin
  login_password:
    description: Its password; comes from Ansible Vault, never logged.
    type: str
    default: ''
  login_unix_socket:
    description: Connect through this unix socket instead of TCP.
    type: str
  connect_timeout:
    description: Seconds to wait for the connection.
    type: float
    default: 10
""" + _TLS_OPTIONS.lstrip("\n") + r"""requirements:
  - the shardfleet library (with PyMySQL) on the host that runs the module
"""

    # the client TLS options alone, for the modules that declare their own login options
    # (extends_documentation_fragment: shardfleet.fleet.mysql.tls)
    TLS = "\noptions:\n" + _TLS_OPTIONS.lstrip("\n")
