# ZooKeeper connection options shared by the shardfleet modules
# (extends_documentation_fragment: shardfleet.fleet.zookeeper).


class ModuleDocFragment:
    DOCUMENTATION = r"""
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
