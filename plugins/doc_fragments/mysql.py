# MySQL connection options shared by the shardfleet modules
# (extends_documentation_fragment: shardfleet.fleet.mysql).


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
requirements:
  - the shardfleet library (with PyMySQL) on the host that runs the module
"""
