#!/usr/bin/env python3
"""Creating shard databases, measured side by side in one run on this machine (not a test).

Three ways to create the same shards (every table of the schema, on fresh
MariaDB host processes started with the same options):

1. the ``shard_databases`` module, one ansible-playbook task;
2. the same DDL piped to the ``mariadb`` command-line client (the practical limit);
3. the obvious Ansible way: a ``community.mysql.mysql_db`` + ``mysql_query`` loop,
   one item per shard, timed on 64 shards and extrapolated.

Then the idempotent rerun of the module over the existing shards.
Goals: (1) <= 1.3x (2); (1) >= 30x faster than (3) extrapolated; rerun <= 5 s.

The three run in alternating rounds (``--rounds``, the order swapped every round, the
shards dropped between rounds, untimed), so that load shifting on a shared machine
falls on all of them: each ratio is the median of the rounds' ratios, and every
round's is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import yaml  # noqa: E402

from shardfleet.schema import default_schema, shard_database  # noqa: E402
from shardfleet.testing import MariaDBServer  # noqa: E402

BIN = Path(sys.executable).parent
SERVER_OPTS = ["--innodb-file-per-table=0"]


def playbook(tmp: Path, tasks: list[dict], extra: list[str] | None = None) -> float:
    pb = tmp / f"pb{time.monotonic_ns()}.yml"
    pb.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False,
                                   "tasks": tasks}]))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    t0 = time.perf_counter()
    p = subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                        "-e", f"ansible_python_interpreter={sys.executable}", str(pb),
                        *(extra or [])], capture_output=True, text=True, env=env, timeout=1800)
    dt = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"playbook failed:\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}")
    return dt


def login(s: MariaDBServer) -> dict:
    return {"login_host": "127.0.0.1", "login_port": s.port, "login_user": "root",
            "login_password": s.root_password}


def ddl_for(shards: range) -> str:
    ddl = default_schema().ddl()
    out = []
    for shard in shards:
        db = shard_database(shard)
        out.append(f"CREATE DATABASE IF NOT EXISTS `{db}` CHARACTER SET utf8mb4 "
                   "COLLATE utf8mb4_unicode_ci;")
        out += [stmt.replace(f"`{t}`", f"`{db}`.`{t}`", 1) + ";" for t, stmt in ddl.items()]
    return "\n".join(out) + "\n"


def count_tables(s: MariaDBServer) -> int:
    return int(s.sql("SELECT COUNT(*) FROM information_schema.TABLES "
                     "WHERE TABLE_SCHEMA REGEXP '^db[0-9]{5}$'")[0][0])


def drop_shards(s: MariaDBServer) -> None:
    names = [r[0] for r in s.sql("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA "
                                 "WHERE SCHEMA_NAME REGEXP '^db[0-9]{5}$'")]
    conn = s.connect()
    try:
        with conn.cursor() as c:
            for name in names:
                c.execute(f"DROP DATABASE `{name}`")
    finally:
        conn.close()


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=4096)
    ap.add_argument("--loop-shards", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-shards-"))
    servers = [MariaDBServer(tmp, server_id=i + 1, extra=SERVER_OPTS).start() for i in range(3)]
    mod, cli, loop = servers
    ntables = len(default_schema().tables)
    sql = ddl_for(range(args.shards))
    ddl = default_schema().ddl()
    module_task = [{"shardfleet.fleet.shard_databases": {
        **login(mod), "range": [0, args.shards - 1], "app_user": ""}}]
    loop_tasks = [
        {"name": "db", "community.mysql.mysql_db": {**login(loop), "name": "{{ item }}",
                                                    "encoding": "utf8mb4"},
         "loop": [shard_database(i) for i in range(args.loop_shards)]},
        {"name": "tables", "community.mysql.mysql_query": {
            **login(loop), "login_db": "{{ item }}", "query": list(ddl.values())},
         "loop": [shard_database(i) for i in range(args.loop_shards)]},
    ]

    def client() -> float:  # 2. the mariadb client, fed the same DDL
        t0 = time.perf_counter()
        subprocess.run(["mariadb", "-h", "127.0.0.1", "-P", str(cli.port), "-u", "root",
                        f"-p{cli.root_password}"], input=sql, text=True, check=True,
                       timeout=1800)
        t = time.perf_counter() - t0
        assert count_tables(cli) == args.shards * ntables
        return t

    def module() -> float:  # 1. the module, one task
        t = playbook(tmp, module_task)
        assert count_tables(mod) == args.shards * ntables
        return t

    def ansible_loop() -> float:  # 3. the obvious Ansible loop, on a sample, extrapolated
        t = playbook(tmp, loop_tasks)
        assert count_tables(loop) == args.loop_shards * ntables
        return t * args.shards / args.loop_shards

    rounds: list[dict[str, float]] = []
    try:
        for k in range(args.rounds):
            sides = [("client", client), ("module", module), ("loop", ansible_loop)]
            if k % 2:
                sides.reverse()
            got = {name: fn() for name, fn in sides}
            if k == args.rounds - 1:  # 4. the idempotent rerun, over the last round's shards
                got["rerun"] = playbook(tmp, module_task)
            rounds.append(got)
            print(f"round {k + 1}: mariadb client {got['client']:.1f}s, shard_databases "
                  f"{got['module']:.1f}s ({got['module'] / got['client']:.2f}x), loop "
                  f"{got['loop']:.0f}s extrapolated ({got['loop'] / got['module']:.0f}x), "
                  f"{args.shards} shards", flush=True)
            if k < args.rounds - 1:
                for s in servers:
                    drop_shards(s)
        t_rerun = rounds[-1]["rerun"]
        r1 = median([r["module"] / r["client"] for r in rounds])
        r2 = median([r["loop"] / r["module"] for r in rounds])
        print(f"shard_databases rerun over {args.shards} existing shards: {t_rerun:.1f}s")
        print(json.dumps({"shards": args.shards, "rounds": [
            {k: round(v, 1) for k, v in r.items()} for r in rounds]}))
        b1 = min(r["module"] / r["client"] for r in rounds)
        b2 = max(r["loop"] / r["module"] for r in rounds)
        print(f"\nshard_databases / mariadb client = {r1:.2f}x median, {b1:.2f}x best of "
              f"{len(rounds)} alternating rounds (goal <= 1.3x) {'OK' if r1 <= 1.3 else 'MISSED'}")
        print(f"mysql_db+mysql_query loop / shard_databases = {r2:.0f}x median, {b2:.0f}x best "
              f"(goal >= 30x) {'OK' if r2 >= 30 else 'MISSED'}")
        print(f"idempotent rerun = {t_rerun:.1f}s (goal <= 5s) "
              f"{'OK' if t_rerun <= 5 else 'MISSED'}")
    finally:
        for s in servers:
            s.stop(remove=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
