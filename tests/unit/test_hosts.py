"""shardfleet.hosts: nothing removes a host the map names as a master or standby."""

from __future__ import annotations

import pytest

from shardfleet.hosts import RemovalRefused, plan_removal, roles_in_map
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
    assert "y" not in msg.split("names:")[1].split(".")[0]
    assert "fleet_data_may_go=true" in msg


def test_a_host_matches_by_name_too():
    m = ShardMap.from_ranges([{"range": [0, 4095], "master": "sf-mysql003a:3306"}])
    with pytest.raises(RemovalRefused):
        plan_removal(m, {"sf-mysql003a": ["10.242.0.61"]})


def test_data_may_go_removes_and_says_what_was_named():
    plan = plan_removal(MAP, {"x": ["10.0.0.11"]}, {"a": ["10.0.0.12"]}, data_may_go=True)
    assert plan.removable == ["x"] and plan.allowed == {"x": ["master of [0, 511] (open)"]}
    assert plan.kept == {"a": ["standby of [0, 511] (open)"]}, "unlisted ones stay kept"


def test_without_a_map_everything_may_go():
    plan = plan_removal(None, {"x": ["10.0.0.11"]}, {"a": ["10.0.0.12"]})
    assert sorted(plan.removable) == ["a", "x"] and not plan.kept
