# Shared option documentation of the shardfleet modules.


class ModuleDocFragment:
    MYSQL = r"""
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

    ZOOKEEPER = r"""
options:
  zookeeper_hosts:
    description: ZooKeeper ensemble, C(host:port) strings or one comma-separated string.
    type: list
    elements: str
    required: true
  zookeeper_root:
    description: The project's root znode.
    type: str
    default: /shardfleet
  cluster:
    description: Cluster name; the map lives at C(<zookeeper_root>/<cluster>/map).
    type: str
    default: default
  zookeeper_user:
    description: Digest user allowed to write under the root (the C(zookeeper) role's admin user).
    type: str
  zookeeper_password:
    description: Its password; comes from Ansible Vault, never logged.
    type: str
  zookeeper_timeout:
    description: Seconds to wait for ZooKeeper.
    type: float
    default: 10
requirements:
  - the shardfleet library (with kazoo) on the host that runs the module
"""
