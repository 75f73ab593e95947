"""Each role's meta/argument_specs.yml against defaults/main.yml and against what the
roles' callers give them.

When a role starts, ansible-core prepends a `validate_argument_spec` task for its entry
point (`main`, or the `tasks_from` name); the task templates every variable of the spec
that the host has (role defaults included, so a Jinja default is evaluated right then)
and checks the values with ArgumentSpecValidator. A spec that refuses what an inventory,
a molecule scenario or a test gives a role therefore breaks that run before its first
task. Here the same happens without a host: the real plays are loaded (site.yml, every
playbook, the molecule scenarios), ansible-core builds each role's validation task, and
the task's own spec is applied, as the action plugin does, to the variables
VariableManager gives that task on each host:

- inventories/local (the local fleet, the e2e tier's copy of it), with the extra vars
  the tests pass (`-e shards_last=255`: a string, as on the command line);
- an inventory shaped like inventories/aws: the shipped aws_ec2 file's `compose` and
  `groups` evaluated over instances tagged as the ec2_fleet role tags them, its
  group_vars, and the vault.yml.example values;
- each molecule scenario's inventory (platforms, group_vars, host_vars);
- provision-aws.yml on localhost with the extra vars of tests/aws and docs/aws.md.

Facts are the one thing faked: plays that gather them get a default IPv4 address; plays
with `gather_facts: false` get none. Nothing connects anywhere.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p.parents[1].name for p in (ROOT / "roles").glob("*/tasks/main.yml"))
NS = "shardfleet.fleet"
SPEC_TYPES = {"str", "int", "float", "bool", "list", "dict", "path", "raw"}
# The MySQL group stands in for plays whose hosts only exist at run time (add_host
# groups such as promote_rebuild or backup_standbys are always MySQL hosts).
HOME_GROUP = {"mysql": "mysql", "shards": "mysql", "zookeeper": "zookeeper", "redis": "redis",
              "memcached": "memcached", "ec2_fleet": "localhost"}


def _specs(role: str) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    return dict(data["argument_specs"])


def _defaults(role: str) -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()) or {})


def _comments(role: str) -> dict[str, str]:
    """{variable: the comment lines right above it} from defaults/main.yml."""
    out, comment = {}, []
    for line in (ROOT / "roles" / role / "defaults" / "main.yml").read_text().splitlines():
        if line.startswith("#"):
            comment.append(line.lstrip("#").strip())
            continue
        m = re.match(r"^([a-z][a-z0-9_]*):", line)
        if m:
            out[m.group(1)] = " ".join(comment)
        comment = []
    return out


def _first_paragraph(option: dict[str, Any]) -> str:
    desc = option.get("description") or [""]
    return " ".join(str(desc if isinstance(desc, str) else desc[0]).split())


def _is_template(value: Any) -> bool:
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, list):
        return any(_is_template(v) for v in value)
    if isinstance(value, dict):
        return any(_is_template(v) for v in value.values())
    return False


# --- the specs against defaults/main.yml ---------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_every_role_has_a_main_entry_point(role: str) -> None:
    specs = _specs(role)
    assert "main" in specs, f"roles/{role}/meta/argument_specs.yml has no `main` entry point"
    for name, entry in specs.items():
        assert entry.get("short_description") and entry.get("description"), f"{role}:{name}"
        assert entry.get("options"), f"{role}:{name} documents no options"


@pytest.mark.parametrize("role", ROLES)
def test_the_spec_covers_every_default_with_the_same_value(role: str) -> None:
    options = _specs(role)["main"]["options"]
    defaults = _defaults(role)
    missing = sorted(set(defaults) - set(options))
    assert not missing, f"roles/{role}: defaults/main.yml variables the spec lacks: {missing}"
    for name, value in defaults.items():
        opt = options[name]
        assert not opt.get("required"), (
            f"roles/{role}: {name} is required but has a default in defaults/main.yml, "
            "so it can never be missing")
        if "default" in opt:
            assert opt["default"] == value and type(opt["default"]) is type(value), (
                f"roles/{role}: {name}: the spec's default {opt['default']!r} is not "
                f"defaults/main.yml's {value!r}")
        else:
            assert _is_template(value), (
                f"roles/{role}: {name}: give the spec `default: {value!r}` (only a Jinja "
                "default may be left out)")
    for name, opt in options.items():
        if "default" in opt:
            assert name in defaults, (
                f"roles/{role}: {name} has a default in the spec but none in "
                "defaults/main.yml, which is where the role gets its values")
        if opt.get("required"):
            assert "default" not in opt, f"roles/{role}: {name} is required and has a default"


@pytest.mark.parametrize("role", ROLES)
def test_each_defaults_comment_is_the_first_line_of_the_description(role: str) -> None:
    options = _specs(role)["main"]["options"]
    for name, comment in _comments(role).items():
        assert comment, f"roles/{role}/defaults/main.yml: {name} has no comment above it"
        assert _first_paragraph(options[name]) == comment, (
            f"roles/{role}: {name}: the description's first line and the comment in "
            f"defaults/main.yml differ:\n  spec:     {_first_paragraph(options[name])}\n"
            f"  defaults: {comment}")


def _walk(options: dict[str, Any], where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, opt in options.items():
        yield f"{where}.{name}", opt
        yield from _walk(opt.get("options") or {}, f"{where}.{name}")


@pytest.mark.parametrize("role", ROLES)
def test_every_option_is_typed_and_described_and_secrets_are_hidden(role: str) -> None:
    for entry, spec in _specs(role).items():
        for where, opt in _walk(spec["options"], f"{role}:{entry}"):
            assert opt.get("description"), f"{where} has no description"
            assert opt.get("type") in SPEC_TYPES, f"{where}: type {opt.get('type')!r}"
            if opt["type"] == "list":
                assert opt.get("elements") in SPEC_TYPES, f"{where}: a list says its elements"
            if "password" in where.rsplit(".", 1)[-1]:
                assert opt.get("no_log") is True, f"{where} is a secret: no_log: true"


@pytest.mark.parametrize("role", ROLES)
def test_the_specs_own_defaults_pass_it(role: str) -> None:
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    for entry, spec in _specs(role).items():
        values = {n: o["default"] for n, o in spec["options"].items() if "default" in o}
        required = {n: "x" for n, o in spec["options"].items() if o.get("required")}
        for n in required:
            choices = spec["options"][n].get("choices")
            required[n] = choices[0] if choices else "x"
        result = ArgumentSpecValidator(spec["options"]).validate({**values, **required})
        assert not result.error_messages, f"{role}:{entry}: {result.error_messages}"


def test_every_tasks_from_has_an_entry_point() -> None:
    """ansible-core validates only an entry point named exactly as `tasks_from` says
    (`library.yml` would skip the `library` spec)."""
    used: set[tuple[str, str]] = set()
    for path in [*ROOT.glob("playbooks/*.yml"), *ROOT.glob("molecule/*/*.yml"),
                 *ROOT.glob("roles/*/tasks/*.yml")]:
        text = path.read_text()
        for m in re.finditer(r"name: (?:shardfleet\.fleet\.)?(\w+)\s*\n\s*tasks_from: (\S+)", text):
            used.add((m.group(1), m.group(2)))
    assert used, "no tasks_from found: the pattern above no longer matches the playbooks"
    for role, entry in sorted(used):
        assert entry in _specs(role), (
            f"tasks_from: {entry} of role {role} has no entry point in its argument_specs.yml")


# --- the callers' values against the specs ---------------------------------------------


@dataclass
class Checked:
    """What one scenario validated and what failed."""

    # (playbook, role, entry point, host) of each validation
    runs: list[tuple[str, str, str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def ansible() -> Any:
    """ansible-core with the checkout's collection on the collections path (.collections)."""
    from ansible.plugins.loader import init_plugin_loader

    init_plugin_loader([str(ROOT / ".collections")])
    import ansible as mod

    return mod


def _facts(hostvars: dict[str, Any]) -> dict[str, Any]:
    address = str(hostvars.get("shardfleet_address") or hostvars.get("shardfleet_container_ip")
                  or "192.0.2.10")
    return {"default_ipv4": {"address": address}, "os_family": "Debian",
            "distribution": "Debian", "distribution_major_version": "12"}


def _validation_tasks(play: Any, vm: Any, loader: Any) -> Iterator[tuple[str, Any]]:
    """(role name, the validation task ansible-core built) for every role of *play*:
    its `roles:` and its include_role/import_role tasks of this collection."""
    from ansible.playbook.block import Block
    from ansible.playbook.role_include import IncludeRole

    def first_task(blocks: list[Any]) -> Any:
        for b in blocks:
            for t in b.block:
                return t.block[0] if isinstance(t, Block) else t
        return None

    for role in play.get_roles():
        if role.get_name().startswith(f"{NS}."):
            yield role.get_name(), first_task(role.compile(play=play))

    def tasks(blocks: list[Any]) -> Iterator[Any]:
        for b in blocks:
            for t in [*b.block, *b.rescue, *b.always]:
                if isinstance(t, Block):
                    yield from tasks([t])
                else:
                    yield t

    for t in tasks(play.tasks + play.pre_tasks + play.post_tasks):
        if isinstance(t, IncludeRole) and str(t._role_name).startswith(f"{NS}."):
            blocks, _handlers = t.get_block_list(play=play, variable_manager=vm, loader=loader)
            yield t._role_name, first_task(blocks)


def _check(playbooks: list[Path], inventory: Path | str, extra_vars: list[str],
           checked: Checked, *, facts: bool = True) -> None:
    """Load *playbooks* the way ansible-playbook does and validate every role's entry
    point on every host it would run on; with facts for the plays that gather them, or
    (*facts* false) with none at all."""
    from ansible import context
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
    from ansible.module_utils.common.collections import ImmutableDict
    from ansible.parsing.dataloader import DataLoader
    from ansible.playbook import Playbook
    from ansible.template import Templar
    from ansible.utils.vars import combine_vars, load_extra_vars
    from ansible.vars.hostvars import HostVars
    from ansible.vars.manager import VariableManager

    # -e, parsed by ansible-core as the CLI's (load_extra_vars keeps the first result it
    # made on itself: cleared before and after)
    saved = context.CLIARGS
    context.CLIARGS = ImmutableDict(extra_vars=tuple(extra_vars))
    load_extra_vars.extra_vars = None  # type: ignore[attr-defined]
    try:
        loader = DataLoader()
        inv = InventoryManager(loader=loader, sources=[str(inventory)])
        vm = VariableManager(loader=loader, inventory=inv)
    finally:
        context.CLIARGS = saved
        load_extra_vars.extra_vars = None  # type: ignore[attr-defined]
    HostVars(inventory=inv, variable_manager=vm, loader=loader)  # registers itself as hostvars
    for path in playbooks:
        for play in Playbook.load(str(path), variable_manager=vm, loader=loader).get_plays():
            gathers = facts and play.gather_facts is not False
            for role, task in _validation_tasks(play, vm, loader):
                short = role.split(".")[-1]
                where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}"
                if task is None or task.action != "ansible.builtin.validate_argument_spec":
                    checked.errors.append(f"{where}: {role} runs with no argument spec validation")
                    continue
                try:
                    pattern = Templar(loader=loader, variables=vm.get_vars(play=play)).template(
                        play.hosts)
                    hosts = inv.get_hosts(pattern) or inv.get_hosts(HOME_GROUP[short])
                except AnsibleError:
                    hosts = inv.get_hosts(HOME_GROUP[short])
                entry = task.args["validate_args_context"]["argument_spec_name"]
                for host in hosts:
                    if gathers:
                        vm.set_host_facts(host.name, _facts(host.get_vars()))
                    else:
                        vm.clear_facts(host.name)
                    task_vars = vm.get_vars(play=play, host=host, task=task)
                    spec = task.args["argument_spec"]
                    label = f"{where}: {role}:{entry} on {host.name}"
                    try:  # what validate_argument_spec's action does with them
                        args = Templar(loader=loader, variables=task_vars).template(
                            {k: task_vars[k] for k in spec if k in task_vars})
                        provided = task.args.get("provided_arguments") or {}
                        result = ArgumentSpecValidator(spec).validate(
                            combine_vars(args, provided), validate_role_argument_spec=True)
                        checked.errors += [f"{label}: {e}" for e in result.error_messages]
                    except AnsibleError as exc:
                        checked.errors.append(f"{label}: {exc.message}")
                    checked.runs.append((where, short, entry, host.name))


# provision-aws.yml runs ec2_fleet on the controller: its own tests below.
PLAYBOOKS = sorted(p for p in (ROOT / "playbooks").glob("*.yml")
                   if not p.is_symlink() and p.name != "provision-aws.yml")
# Roles no playbook runs yet.
NO_PLAY_YET: tuple[str, ...] = ()
# Roles other roles include (include_role, at run time: not seen by this static walk): the
# mysql and redis roles include tls_cert when TLS is on, validated then (the e2e tier and
# molecule/mysql run it).
INCLUDED_BY_ROLES = ("tls_cert",)
# tests/aws/test_site_e2e.py runs site.yml with these (strings, as -e k=v gives them).
SHARD_VARS = ["shards_last=255", "shards_mod_shard_count=256"]


@pytest.mark.parametrize("extra", [[], SHARD_VARS], ids=["plain", "tests-aws-shard-vars"])
def test_the_local_inventory_passes_every_role_of_every_playbook(ansible: Any,
                                                               extra: list[str]) -> None:
    checked = Checked()
    _check(PLAYBOOKS, ROOT / "inventories" / "local", extra, checked)
    assert not checked.errors, "\n".join(checked.errors)
    ran = {(r, e) for _, r, e, _ in checked.runs}
    # site.yml runs the shards role's steps one by one (its converged fast path)
    shard_steps = {("shards", e) for e in ("library", "read", "decide", "databases", "map",
                                           "writable")}
    expected = {(r, "main") for r in ROLES
                if r not in ("ec2_fleet", "shards", *NO_PLAY_YET, *INCLUDED_BY_ROLES)} \
        | shard_steps
    assert expected <= ran, f"not validated: {sorted(expected - ran)}"
    # every host of site.yml's plays, each of its roles
    site = {(r, h) for p, r, e, h in checked.runs if p == "playbooks/site.yml"}
    # mysql, zookeeper, redis, memcached, shards; monitoring on all ten, the library on
    # the monitoring host
    assert len(site) == 4 + 3 + 1 + 1 + 4 + 10 + 1, sorted(site)


def test_no_role_needs_facts_to_validate(ansible: Any) -> None:
    """The validation task is tagged `always`: `site.yml --tags shards` runs the mysql
    play's validation while that play's fact gathering (tagged servers, mysql) is
    skipped. A default that needs a fact to template would fail it there."""
    checked = Checked()
    _check(PLAYBOOKS, ROOT / "inventories" / "local", [], checked, facts=False)
    assert not checked.errors, "\n".join(checked.errors)
    assert len(checked.runs) > 13, checked.runs


def _aws_shaped_inventory(ansible: Any, dest: Path) -> Path:
    """inventories/aws as the aws_ec2 plugin would yield it for a fleet the ec2_fleet role
    built (2 pairs, 3 ZooKeeper, 1 Redis, 1 memcached, 1 monitoring): the shipped file's
    `compose` and `groups` evaluated over each instance's tags and addresses."""
    from ansible.errors import AnsibleError
    from ansible.template import Templar, trust_as_template

    plugin = yaml.safe_load((ROOT / "inventories/aws/shardfleet.aws_ec2.yml").read_text())
    instances: list[dict[str, str]] = []
    for pair in (1, 2):
        for side in "ab":
            instances.append({"Name": f"sfaws-mysql{pair:03d}{side}", "component": "mysql",
                              "index": str(pair), "pair": f"pair{pair:03d}", "side": side})
    for component, stem, count in (("zookeeper", "zk", 3), ("redis", "redis", 1),
                                   ("memcached", "memcached", 1), ("monitoring", "monitor", 1)):
        instances += [{"Name": f"sfaws-{stem}{i}", "component": component, "index": str(i)}
                      for i in range(1, count + 1)]
    hosts: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {g: {"hosts": {}} for g in plugin["groups"]}
    for n, tags in enumerate(instances):
        ec2 = {"ec2_tags": {**tags, "cluster": "sfaws"},
               "ec2_private_ip_address": f"10.42.0.{n + 10}",
               "ec2_public_ip_address": f"198.51.100.{n + 10}"}
        templar = Templar(variables=ec2)
        hv = dict(ec2)
        for var, expr in plugin["compose"].items():
            try:
                hv[var] = templar.template(trust_as_template("{{ " + expr + " }}"))
            except AnsibleError:  # the plugin's strict: false leaves the variable out
                pass
        hosts[tags["Name"]] = hv
        for group, cond in plugin["groups"].items():
            if templar.template(trust_as_template("{{ " + cond + " }}")):
                groups[group]["hosts"][tags["Name"]] = None
    inv = dest / "inventory"
    shutil.copytree(ROOT / "inventories" / "aws" / "group_vars", inv / "group_vars")
    vault = inv / "group_vars" / "all"
    shutil.copy(vault / "vault.yml.example", vault / "vault.yml")
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts, "children": groups}}))
    return inv


def test_an_aws_shaped_inventory_passes_site_yml(ansible: Any, tmp_path: Path) -> None:
    inv = _aws_shaped_inventory(ansible, tmp_path)
    checked = Checked()
    _check([ROOT / "playbooks" / "site.yml"], inv, SHARD_VARS, checked)
    assert not checked.errors, "\n".join(checked.errors)
    # mysql, zookeeper, redis, memcached, shards; monitoring on all ten, the library on
    # the monitoring host
    # (the shards role's six steps on each MySQL host)
    assert len(checked.runs) == 4 + 3 + 1 + 1 + 6 * 4 + 10 + 1, checked.runs


def _molecule_scenario(name: str, dest: Path) -> tuple[Path, list[Path]]:
    """(the scenario's inventory, its converge and verify playbooks with the roles named
    by FQCN: molecule loads them by path from roles/, the same directories)."""
    cfg = yaml.safe_load((ROOT / "molecule" / name / "molecule.yml").read_text())
    children: dict[str, dict[str, Any]] = {}
    for p in cfg["platforms"]:
        for g in p.get("groups", []):
            children.setdefault(g, {"hosts": {}})["hosts"][p["name"]] = None
    inv = dest / "inventory"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "host_vars").mkdir()
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": children}}))
    for group, values in (cfg["provisioner"].get("inventory", {}).get("group_vars") or {}).items():
        (inv / "group_vars" / f"{group}.yml").write_text(yaml.safe_dump(values))
    for host, values in (cfg["provisioner"].get("inventory", {}).get("host_vars") or {}).items():
        (inv / "host_vars" / f"{host}.yml").write_text(yaml.safe_dump(values))
    books = []
    for pb in ("converge.yml", "verify.yml"):
        src = ROOT / "molecule" / name / pb
        if src.exists():
            text = re.sub(rf"(role|name): ({'|'.join(ROLES)})\s*$", rf"\1: {NS}.\2",
                          src.read_text(), flags=re.M)
            # a playbook the scenario imports by its path in the checkout
            text = text.replace("../../playbooks/", f"{ROOT}/playbooks/")
            (dest / pb).write_text(text)
            books.append(dest / pb)
    return inv, books


SCENARIOS = sorted(p.parent.name for p in ROOT.glob("molecule/*/molecule.yml"))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_molecule_scenario_passes_its_role(ansible: Any, tmp_path: Path,
                                                scenario: str) -> None:
    inv, books = _molecule_scenario(scenario, tmp_path)
    checked = Checked()
    _check(books, inv, [], checked)
    assert not checked.errors, "\n".join(checked.errors)
    assert {r for _, r, _, _ in checked.runs} == {scenario}, checked.runs


def _aws_test_vars() -> list[dict[str, Any]]:
    """The extra vars tests/aws passes provision-aws.yml (helpers.TEST_BASE_VARS plus each
    test's table) and the docs' command lines'."""
    from tests.aws.helpers import TEST_BASE_VARS
    from tests.aws.test_provision import table
    from tests.aws.test_site_e2e import FLEET_VARS

    base = {**TEST_BASE_VARS, "ec2_fleet_endpoint_url": "http://127.0.0.1:1"}
    empty = table(pairs=0, zookeeper=0)
    for component in ("redis", "memcached"):
        empty["ec2_fleet_components"][component]["count"] = 0
    return [{**base, **FLEET_VARS}, {**base, **table(pairs=2)}, {**base, **table(pairs=3)},
            {**base, **table(pairs=2), "ec2_fleet_terminate_extra": True},
            {**base, **empty, "ec2_fleet_terminate_extra": True},
            {**base, **table(pairs=1), "ec2_fleet_admin_cidr": ""}]  # refused by the role's assert


@pytest.mark.parametrize("n", range(6))
def test_the_aws_tier_vars_pass_ec2_fleet(ansible: Any, n: int) -> None:
    checked = Checked()
    _check([ROOT / "playbooks" / "provision-aws.yml"], "localhost,",
           [json.dumps(_aws_test_vars()[n])], checked)
    assert not checked.errors, "\n".join(checked.errors)
    assert [r for _, r, _, _ in checked.runs] == ["ec2_fleet"], checked.runs


def test_the_docs_command_line_passes_ec2_fleet(ansible: Any) -> None:
    """docs/aws.md: -e ec2_fleet_admin_cidr=203.0.113.7/32 -e ec2_fleet_key_name=ops, and
    the teardown's -e ec2_fleet_terminate_extra=true (a string)."""
    checked = Checked()
    _check([ROOT / "playbooks" / "provision-aws.yml"], "localhost,",
           ["ec2_fleet_admin_cidr=203.0.113.7/32", "ec2_fleet_key_name=ops",
            "ec2_fleet_terminate_extra=true", "ec2_fleet_region=eu-west-1"], checked)
    assert not checked.errors, "\n".join(checked.errors)
    assert len(checked.runs) == 1


# --- and the specs do refuse what would break a role ----------------------------------


@pytest.mark.parametrize(("book", "extra", "expect"), [
    ("site.yml", ["mysql_side=c"], "mysql_side must be one of: a, b"),
    ("site.yml", ["mysql_port=three"], "mysql_port"),
    ("site.yml", ['{"mysql_extra_settings": ["a"]}'], "mysql_extra_settings"),
    ("site.yml", ["zookeeper_id=one"], "zookeeper_id"),
    ("site.yml", ["redis_maxmemory_policy=lru"], "redis_maxmemory_policy must be one of"),
    ("site.yml", ["redis_appendonly=maybe"], "redis_appendonly"),
    ("site.yml", ["shards_range_state=frozen"], "shards_range_state must be one of"),
    ("site.yml", ["shards_mod_shard_count=many"], "shards_mod_shard_count"),
    ("backup.yml", ['{"shards_library_packages": {"a": 1}}'], "shards_library_packages"),
])
def test_a_bad_value_fails_the_role_at_its_start(ansible: Any, book: str, extra: list[str],
                                                 expect: str) -> None:
    checked = Checked()
    _check([ROOT / "playbooks" / book], ROOT / "inventories" / "local", extra, checked)
    assert any(expect in e for e in checked.errors), checked.errors[:5]


def test_a_missing_secret_fails_the_role_at_its_start(ansible: Any, tmp_path: Path) -> None:
    inv, books = _molecule_scenario("mysql", tmp_path)
    group_vars = inv / "group_vars" / "all.yml"
    values = yaml.safe_load(group_vars.read_text())
    del values["mysql_app_password"]
    group_vars.write_text(yaml.safe_dump(values))
    checked = Checked()
    _check(books[:1], inv, [], checked)
    assert checked.errors and all("missing required arguments: mysql_app_password" in e
                                  for e in checked.errors), checked.errors


@pytest.mark.parametrize(("components", "expect"), [
    ({"mysql": {"count": 1, "instance_type": "t3.small"}, "kafka": {"count": 1}}, "kafka"),
    ({"mysql": {"count": "two", "instance_type": "t3.small"}}, "count"),
    ({"mysql": {"count": 1}}, "instance_type"),
    ({"mysql": {"count": 1, "instance_type": "t3.small", "data_volume": {"iops": 3000}}}, "size"),
])
def test_a_bad_component_table_fails_ec2_fleet_at_its_start(ansible: Any,
                                                            components: dict[str, Any],
                                                            expect: str) -> None:
    checked = Checked()
    _check([ROOT / "playbooks" / "provision-aws.yml"], "localhost,",
           [json.dumps({"ec2_fleet_admin_cidr": "198.51.100.0/24",
                        "ec2_fleet_components": components})], checked)
    assert any(expect in e for e in checked.errors), checked.errors
