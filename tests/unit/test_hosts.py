"""shardfleet.hosts: nothing removes a host the map names as a master or standby."""

from __future__ import annotations

import pytest

from shardfleet.hosts import (
    AdditionRefused,
    RemovalRefused,
    check_addition,
    plan_removal,
    roles_in_map,
    zookeeper_members,
)
from shardfleet.ops import InFlight
from shardfleet.shardmap import ShardMap

MAP = ShardMap.from_ranges([
    {"range": [0, 511], "master": "10.0.0.11:3306", "standby": "10.0.0.12:3306"},
    {"range": [512, 4095], "master": "[fd00::1]:3306", "state": "closed"},
])


def test_roles_name_each_host_by_its_address_without_the_port():
    assert roles_in_map(MAP) == {"10.0.0.11": ["master of [0, 511] (open)"],
                                 "10.0.0.12": ["standby of [0, 511] (open)"],
                                 "fd00::1": ["master of [512, 4095] (closed)"]}
    assert roles_in_map(None) == {}


def test_an_unlisted_host_the_map_names_is_kept_the_others_may_go():
    plan = plan_removal(MAP, {}, {"a": ["10.0.0.12"], "b": ["10.0.0.99"], "c": ["fd00::1"]})
    assert plan.removable == ["b"]
    assert plan.kept == {"a": ["standby of [0, 511] (open)"],
                         "c": ["master of [512, 4095] (closed)"]}


def test_a_host_to_remove_the_map_names_is_refused_naming_its_ranges():
    with pytest.raises(RemovalRefused) as refused:
        plan_removal(MAP, {"x": ["10.0.0.11"], "y": ["10.0.0.50"]})
    msg = str(refused.value)
    assert "x is master of [0, 511] (open)" in msg and "nothing was removed" in msg
    assert "y" not in msg.split("names them):")[1].split(".")[0]
    assert "fleet_data_may_go=true" in msg


def test_a_host_matches_by_name_too():
    m = ShardMap.from_ranges([{"range": [0, 4095], "master": "sf-mysql003a:3306"}])
    with pytest.raises(RemovalRefused):
        plan_removal(m, {"sf-mysql003a": ["10.242.0.61"]})


def test_data_may_go_removes_and_says_what_was_named():
    plan = plan_removal(MAP, {"x": ["10.0.0.11"]}, {"a": ["10.0.0.12"]}, data_may_go=True)
    assert plan.removable == ["x"] and plan.allowed == {"x": ["master of [0, 511] (open)"]}
    assert plan.kept == {"a": ["standby of [0, 511] (open)"]}, "unlisted ones stay kept"




# -- what else holds data: ZooKeeper, operations in flight; no map; hosts to add -------

def _split_in_flight() -> InFlight:
    return InFlight("split-hot", "split", "catching_up",
                    ("10.0.0.11:3306", "10.0.0.21:3306", "10.0.0.22:3306"), 0.0, {})


def test_a_zookeeper_host_is_refused_and_kept_it_holds_the_map():
    zk = ["10.0.0.31:2181", "zk2:2181"]
    with pytest.raises(RemovalRefused) as refused:
        plan_removal(MAP, {"sf-zk1": ["10.0.0.31"]}, zookeeper=zk)
    assert "sf-zk1 is ZooKeeper server 10.0.0.31:2181 (holds the shard map)" in str(refused.value)
    plan = plan_removal(MAP, {}, {"zk2": ["10.0.0.32"]}, zookeeper=zk)
    assert plan.removable == [] and plan.kept == {
        "zk2": ["ZooKeeper server zk2:2181 (holds the shard map)"]}


def test_the_zookeeper_ensemble_members_are_read_from_its_config():
    config = ("server.1=10.0.0.31:2888:3888:participant;0.0.0.0:2181\n"
              "server.2=[fd00::32]:2888:3888;2181\nserver.3=zk3:2888:3888\nversion=100000000\n")
    assert zookeeper_members(config) == ["10.0.0.31:2888", "[fd00::32]:2888", "zk3:2888"]
    assert zookeeper_members("") == [] and zookeeper_members(b"") == []


def test_an_in_flight_split_target_is_refused_and_kept():
    ops = [_split_in_flight()]
    with pytest.raises(RemovalRefused) as refused:
        plan_removal(MAP, {"new5a": ["10.0.0.21"], "other": ["10.0.0.99"]}, in_flight=ops)
    msg = str(refused.value)
    assert "new5a is a server of split split-hot (step catching_up" in msg, msg
    assert "refusing to remove 1 host(s)" in msg
    plan = plan_removal(MAP, {}, {"new5b": ["10.0.0.22"]}, in_flight=ops)
    assert plan.removable == [] and list(plan.kept) == ["new5b"]
    plan = plan_removal(MAP, {"new5a": ["10.0.0.21"]}, in_flight=ops, data_may_go=True)
    assert plan.removable == ["new5a"] and "split split-hot" in plan.allowed["new5a"][0]


def test_without_a_map_nothing_is_removed_and_the_error_says_why():
    """A wrong shards_cluster reads no map: that is "cannot tell", not "nothing held"."""
    why = "there is no shard map at /shardfleet/typo/map"
    with pytest.raises(RemovalRefused) as refused:
        plan_removal(None, {"x": ["10.0.0.11"]}, {"a": ["10.0.0.12"]}, no_map=why)
    msg = str(refused.value)
    assert why in msg and "x" in msg and "nothing was removed" in msg, msg
    assert "fleet_data_may_go=true" in msg
    plan = plan_removal(None, {}, {"a": ["10.0.0.12"]}, no_map=why)
    assert plan.removable == [] and plan.kept == {"a": [f"not checked: {why}"]}
    plan = plan_removal(None, {"x": ["10.0.0.11"]}, {"a": ["10.0.0.12"]}, data_may_go=True)
    assert plan.removable == ["x"] and "a" in plan.kept and "x" in plan.allowed


def test_a_host_to_add_may_not_take_an_address_or_name_the_map_still_names():
    """A server removed with data_may_go stays in the map: a new empty one at its address
    (or name) would take that range's traffic."""
    with pytest.raises(AdditionRefused) as refused:
        check_addition(MAP, {"sf-mysql003a": ["10.0.0.12"], "sf-mysql003b": ["10.0.0.77"]})
    msg = str(refused.value)
    assert "sf-mysql003a (10.0.0.12) is standby of [0, 511] (open)" in msg, msg
    assert "sf-mysql003b" not in msg and "nothing changed" in msg
    m = ShardMap.from_ranges([{"range": [0, 4095], "master": "sf-mysql004a:3306"}])
    with pytest.raises(AdditionRefused):
        check_addition(m, {"sf-mysql004a": []})
    with pytest.raises(AdditionRefused, match="split split-hot"):
        check_addition(MAP, {"n": ["10.0.0.22"]}, in_flight=[_split_in_flight()])
    named = check_addition(MAP, {"sf-mysql005a": ["10.0.0.91"]}, zookeeper=["10.0.0.31:2181"])
    assert named == {"10.0.0.11": ["master of [0, 511] (open)"],
                     "10.0.0.12": ["standby of [0, 511] (open)"],
                     "fd00::1": ["master of [512, 4095] (closed)"],
                     "10.0.0.31": ["ZooKeeper server 10.0.0.31:2181 (holds the shard map)"]}
    with pytest.raises(AdditionRefused, match="no shard map at /x/map"):
        check_addition(None, {"sf-mysql005a": []}, no_map="there is no shard map at /x/map")
