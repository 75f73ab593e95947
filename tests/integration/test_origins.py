"""The origins check (shardfleet.testing.origins) against real servers: a master-master
pair, a ZooKeeper, the kit's writer through a router, and writes made behind the
router's back (a broken fence) that only the servers' binary logs can tell about."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from shardfleet import ids, provision
from shardfleet.mapstore import NO_NODE, MemoryMapStore, ZooKeeperMapStore
from shardfleet.router import Router
from shardfleet.schema import default_schema, shard_database
from shardfleet.shardmap import ShardMap
from shardfleet.store import Store
from shardfleet.testing.history import History
from shardfleet.testing.kit import (
    APP_PASSWORD,
    APP_USER,
    PIN,
    Writer,
    make_server,
    pair_up,
    wait_pair_synced,
)
from shardfleet.testing.origins import (
    MapTimeline,
    Observation,
    _verdict,
    audit_origins,
    binlog_writes,
    check_origins,
    decode_string,
)

pytestmark = pytest.mark.integration

SHARDS = [0, 1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two servers master-master (GTID, log-slave-updates), shards 0-1 on both."""
    base = tmp_path_factory.mktemp("origins")
    a = make_server(base, 61, "a")
    b = None
    try:
        b = make_server(base, 62, "b")
        pair_up(a, b)
        conn = a.connect(client_flag=provision.multi_statement_flags())
        try:
            provision.ensure_shards(conn, SHARDS, default_schema(), app_user=APP_USER)
        finally:
            conn.close()
        wait_pair_synced(a, b)
        yield a, b
    finally:
        for s in (a, b):
            if s is not None:
                s.stop(remove=True)


def shard_map(master: str, standby: str | None) -> ShardMap:
    return ShardMap.from_ranges([{"range": [0, 1], "master": master, "standby": standby,
                                  "state": "open"}], mod_shard_count=2)


class Fleet:
    """One test's cluster: its map (naming the pair's first node), a timeline over it and a
    router + store."""

    def __init__(self, zk: str, a, b, tmp) -> None:
        self.a, self.b = a, b
        self.cluster = "o" + uuid.uuid4().hex[:10]
        self.admin = ZooKeeperMapStore(zk, self.cluster)
        self.version = self.admin.write(shard_map(a.address, b.address), NO_NODE)
        self.timeline = MapTimeline.for_cluster(zk, self.cluster).start()
        self.router = Router(ZooKeeperMapStore(zk, self.cluster), cache_file=tmp / "map.json",
                             user=APP_USER, password=APP_PASSWORD, frozen_wait=1.0)
        self.store = Store(self.router)

    def flip(self, master, standby) -> Observation:
        """Name *master* in the map; return the timeline's observation of it once the
        router has it too."""
        self.version = self.admin.write(shard_map(master.address, standby.address),
                                        self.version)
        seen = self.timeline.wait_version(self.version, 30)
        assert self.router.wait_for(
            lambda m: m.range_for(0).master == master.address, 30)
        return seen

    def close(self) -> None:
        self.timeline.stop()
        self.store.close()
        self.router.close()
        self.admin.close()


@pytest.fixture
def fleet(zookeeper, pair, tmp_path):
    a, b = pair
    f = Fleet(zookeeper.address, a, b, tmp_path)
    yield f
    f.close()


def run_writer(store: Store, ops: int, history: History | None = None,
               tag: str | None = None) -> Writer:
    w = Writer(store, SHARDS, threads=2, seconds=30, max_ops=ops // 2, updates=0.5)
    if history is not None:
        w.log.history = history
    if tag is not None:
        w.log.tag = tag
    w.start()
    assert w.wait_acks(ops, 30, total=True), w.errors
    w.stop()
    assert not w.errors
    return w


def direct_create(server, history: History, shard: int, tag: str) -> int:
    """A create made on *server* itself (bypassing the router), recorded in *history*."""
    k = history.invoke(9, "create", {"shard": shard})
    body = {"v": 0, "w": 9, "tag": tag, "op": k}
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(f"INSERT INTO `{shard_database(shard)}`.`pins` (body) VALUES (%s)",
                        (json.dumps(body),))
            oid = ids.compose(shard, PIN, int(cur.lastrowid))
    finally:
        conn.close()
    history.ok(k, 9, "create", {"shard": shard, "id": oid})
    return oid


def direct_update(server, history: History | None, oid: int, v: int) -> None:
    """A read-modify-write update made on *server* itself, recorded in *history*."""
    k = history.invoke(9, "update", {"id": oid, "v": v}) if history is not None else -1
    o = ids.decompose(oid)
    table = f"`{shard_database(o.shard)}`.`pins`"
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT body FROM {table} WHERE local_id=%s", (o.local,))
            body = json.loads(cur.fetchone()[0])
            body["v"] = v
            cur.execute(f"UPDATE {table} SET body=%s WHERE local_id=%s",
                        (json.dumps(body), o.local))
    finally:
        conn.close()
    if history is not None:
        history.ok(k, 9, "update", {"id": oid, "v": v})


# -- through the router, on the named master ---------------------------------------------
def test_writes_on_the_named_master_pass_across_a_switch(fleet):
    """Writes through the router before and after a proper switch (the map names the other
    node and the router has it): no problems, although each node's log also holds the
    other's writes (replicated, with the originating server's id)."""
    a, b = fleet.a, fleet.b
    before = run_writer(fleet.store, 10)
    wait_pair_synced(a, b)
    fleet.flip(b, a)
    after = run_writer(fleet.store, 10, history=before.log.history, tag=before.log.tag)
    wait_pair_synced(b, a)
    fleet.timeline.stop()
    log = after.log
    res = audit_origins(fleet.timeline, log.history, [a, b], log.tag)
    assert res.problems == [], res.summary()
    assert res.by_origin[a.address] >= 10 and res.by_origin[b.address] >= 10, res.summary()
    assert res.judged == len(res.writes), res.summary()
    # each log holds both nodes' writes: the origin is the event's server id, not the log
    for s in (a, b):
        origins = {w.origin for w in binlog_writes(s, log.tag)}
        assert origins == {a.server_id, b.server_id}, (s.address, origins)
    assert fleet.timeline.master_intervals(0, a.address)[0][1] is not None
    assert fleet.timeline.master_intervals(0, b.address)[0][1] is None


# -- behind the router's back ------------------------------------------------------------
def test_writes_on_the_old_master_after_the_flip_are_reported(fleet):
    """A broken fence: after the map names b (and the timeline saw it), a create and an
    update are accepted by a, recorded as invoked after the flip. Both are reported, once
    each (b's copies of them carry a's id); b's own writes after the flip are not."""
    a, b = fleet.a, fleet.b
    w = run_writer(fleet.store, 4)
    history, tag = w.log.history, w.log.tag
    old = next(iter(w.log.acked))
    seen = fleet.flip(b, a)
    assert seen.time < time.monotonic()
    oid = direct_create(a, history, 1, tag)
    direct_update(a, history, old, w.log.acked[old] + 1)
    run_writer(fleet.store, 4, history=history, tag=tag)  # through the router: on b
    wait_pair_synced(a, b)
    fleet.timeline.stop()
    copies = {(x.kind, x.oid) for x in binlog_writes(b, tag) if x.origin == a.server_id}
    assert {("insert", oid), ("update", old)} <= copies, copies
    res = audit_origins(fleet.timeline, history, [a, b], tag)
    bad = sorted((v.write.kind, v.write.oid, v.server) for v in res.violations)
    assert bad == sorted([("insert", oid, a.address), ("update", old, a.address)]), res.summary()
    assert all(v.observed.version == fleet.version for v in res.violations)
    problems = check_origins(fleet.timeline, history, {a.address: a, b.address: b}, tag)
    assert len(problems) == 1 and "2 write(s) accepted by a server the map no longer named" \
        in problems[0], problems
    assert res.by_origin[b.address] >= 4 and len(res.untied) == 0


def test_a_master_named_again_before_completion_is_not_a_violation(fleet):
    """A flip back to a observed before the operation completed clears the write a
    accepted while the map named b."""
    a, b = fleet.a, fleet.b
    history, tag = History(), uuid.uuid4().hex[:12]
    fleet.flip(b, a)
    k = history.invoke(9, "create", {"shard": 0})  # invoked while the map names b
    conn = a.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("INSERT INTO `db00000`.`pins` (body) VALUES (%s)",
                        (json.dumps({"v": 0, "tag": tag, "op": k}),))
    finally:
        conn.close()
    fleet.flip(a, b)  # a named again before the create completes
    history.ok(k, 9, "create", {"shard": 0})
    wait_pair_synced(a, b)
    res = audit_origins(fleet.timeline, history, [a, b], tag)
    assert res.problems == [] and res.judged == 1, res.summary()


def test_rows_no_operation_wrote_are_reported(fleet):
    """Tagged rows on the named master that the history never invoked (a create's index,
    an update's version), or that carry no index, are reported."""
    a, b = fleet.a, fleet.b
    w = run_writer(fleet.store, 4)
    history, tag = w.log.history, w.log.tag
    old = next(iter(w.log.acked))
    conn = a.connect()
    try:
        with conn.cursor() as cur:
            for body in ({"v": 0, "tag": tag, "op": 12345}, {"v": 0, "tag": tag}):
                cur.execute("INSERT INTO `db00000`.`pins` (body) VALUES (%s)",
                            (json.dumps(body),))
    finally:
        conn.close()
    direct_update(a, None, old, 77)  # no update to version 77 was ever invoked
    wait_pair_synced(a, b)
    res = audit_origins(fleet.timeline, history, [a, b], tag)
    assert res.violations == []
    assert len(res.problems) == 2, res.problems
    assert res.problems[0].startswith("2 tagged row event(s) no operation of the history "
                                      "invoked"), res.problems
    assert "op=12345" in res.problems[0] and "v=77" in res.problems[0]
    assert res.problems[1].startswith("1 tagged row event(s) that cannot be tied"), res.problems
    assert [x.kind for x, _ in res.untied] == ["insert"]


# -- parsing -------------------------------------------------------------------------------
TRICKY = [
    "it's", 'say "hi"', "back\\slash", "\\x41 is not A", "\\'", "'\\''", "line\nbreak\ttab",
    "\x01\x1f control", "é ü 中文 😀", "\u2028 separator", "ends with \\", "'", "",
]


def test_bodies_with_quotes_and_backslashes_round_trip(pair):
    a, b = pair
    tag = uuid.uuid4().hex[:12]
    bodies = [{"v": 0, "tag": tag, "op": i, "s": s, "k'\"\\": [s]} for i, s in enumerate(TRICKY)]
    conn = a.connect()
    try:
        with conn.cursor() as cur:
            for body in bodies:
                cur.execute("INSERT INTO `db00001`.`pins` (body) VALUES (%s)",
                            (json.dumps(body, ensure_ascii=False),))
            # JSON whitespace outside strings (printed as \xNN by mariadb-binlog)
            cur.execute("INSERT INTO `db00001`.`pins` (body) VALUES (%s)",
                        ('{\n\t"v": 0,\r\n "tag": "' + tag + '", "op": 99, "s": "\\\\x0a"}\n',))
            local = int(cur.lastrowid)
            cur.execute("UPDATE `db00001`.`pins` SET body=JSON_SET(body, '$.v', 1) "
                        "WHERE local_id=%s", (local,))
    finally:
        conn.close()
    wait_pair_synced(a, b)
    expected = [*bodies, {"v": 0, "tag": tag, "op": 99, "s": "\\x0a"}]
    for s in (a, b):
        got = binlog_writes(s, tag)
        assert [w.kind for w in got] == ["insert"] * len(expected) + ["update"]
        assert [w.body for w in got[:-1]] == expected
        assert got[-1].v == 1 and got[-1].op == 99 and got[-1].body["s"] == "\\x0a"
        assert {w.origin for w in got} == {a.server_id}
        assert all(w.gtid and w.gtid.startswith(f"{a.server_id}-{a.server_id}-") for w in got)


def test_decode_string():
    assert decode_string(r"{\x0a}") == "{\n}"
    assert decode_string(r'"a\\x41"') == r'"a\\x41"'  # an escaped backslash, then x41
    assert decode_string(r'"\"" \x09') == '"\\"" \t'
    assert decode_string("it's") == "it's"
    assert decode_string("\\") == "\\"


# -- the timeline ----------------------------------------------------------------------------
def test_timeline_named_master_and_intervals():
    store = MemoryMapStore(shard_map("10.0.0.1:3306", None))
    tl = MapTimeline(store).start()
    t1 = time.monotonic()
    store.write(shard_map("10.0.0.2:3306", None), 0)
    t2 = time.monotonic()
    store.write(shard_map("10.0.0.1:3306", None), 1)
    assert tl.wait_version(2, 1).version == 2
    tl.stop()
    store.write(shard_map("10.0.0.3:3306", None), 2)  # after stop: not recorded
    obs = tl.observations
    assert [o.version for o in obs] == [0, 1, 2]
    assert tl.named_master(0, t1) == "10.0.0.1:3306"
    assert tl.named_master(1, t2) == "10.0.0.2:3306"
    assert tl.named_master(0, obs[0].time - 1) is None
    assert tl.named_master(5, t2) is None
    ivs = tl.master_intervals(0, "10.0.0.1:3306")
    assert ivs == [(obs[0].time, obs[1].time), (obs[2].time, None)]
    assert tl.master_intervals(0, "10.0.0.2:3306") == [(obs[1].time, obs[2].time)]


def test_verdicts():
    A, B = "10.0.0.1:3306", "10.0.0.2:3306"

    def obs(*spec):
        return [Observation(t, v, shard_map(m, None)) for t, v, m in spec]

    def verdict(o, window, slack=0.5):
        return _verdict(o, [x.time for x in o], 0, A, window, slack)[0]

    flipped = obs((0, 0, A), (10, 1, B))
    assert verdict(flipped, (11, 12)) == "violation"
    assert verdict(flipped, (9, 12)) == "ok"  # the flip was observed after the invoke
    assert verdict(flipped, (10, 12)) == "ok"  # observed at the invoke: not before it
    assert verdict(obs((0, 0, A), (10, 1, B), (12.2, 2, A)), (11, 12)) == "ok"  # slack
    assert verdict(obs((0, 0, A), (10, 1, B), (13, 2, A)), (11, 12)) == "violation"
    assert verdict(obs((0, 0, A), (10, 1, B), (11.5, 3, B)), (11, 12)) == "map versions unseen"
    assert verdict(obs((0, 0, B)), (11, 12)) == "never named master of the shard"
    assert verdict(flipped, (-1, 12)) == "no map observed before the operation"
