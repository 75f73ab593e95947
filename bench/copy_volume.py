#!/usr/bin/env python3
"""Copying a pair's data at volume (not a test): a source MariaDB holding --gib GiB across
its shards (the schema's tables, JSON bodies of about 1 KiB, mapping rows; generation is
not measured), then, one after another in one run on the same data:

* raw limit: ``mariadb-backup --backup --stream=mbstream | mbstream -x`` on this machine,
  then ``--prepare``: what the hardware and the tool do with nothing of ours around them;
* physical (the rebuild's path, shardfleet.physical): the same backup sent through the
  challenge-checked TCP stream to a receiver that extracts it, then prepared (goal
  <= 1.2x the raw limit); installing it into a stopped server and starting it is
  printed apart;
* logical (the old rebuild path, promote.copy_shards): mariadb-dump of every shard
  database through this process into another server (goal: physical >= 5x faster);
* backup to S3 (shardfleet.backup.backup, the product path: the stream uploaded with
  multipart, the manifest's per-shard checksums taken in the backup's snapshot) and
  restore from it (shardfleet.backup.restore: download, sha256, prepare, install, verify
  every checksum), each against the raw limit (goal <= 1.5x). S3 is moto's server on
  127.0.0.1, which is a Python process: its own rate (a multipart upload and a download
  of as many bytes from memory, nothing of ours) is printed beside them.

Each figure is printed with its MB/s and the ratios. Host processes on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from shardfleet import physical, promote, provision  # noqa: E402
from shardfleet.schema import default_schema  # noqa: E402
from shardfleet.testing import MariaDBServer  # noqa: E402


def server(base: Path, sid: int) -> MariaDBServer:
    return MariaDBServer(base, server_id=sid, extra=[
        "--innodb-buffer-pool-size=512M", "--innodb-log-file-size=256M",
        "--max-allowed-packet=64M"]).start()


def generate(src: MariaDBServer, shards: int, gib: float) -> int:
    """Fill *shards* shard databases until the data files hold about *gib* GiB."""
    conn = src.connect(client_flag=provision.multi_statement_flags())
    provision.ensure_shards(conn, list(range(shards)), default_schema())
    rng = random.Random(7)
    words = ["pin", "board", "recipe", "travel", "garden", "kitchen", "diy", "art", "film"]
    body = json.dumps({"title": " ".join(rng.choice(words) for _ in range(12)),
                       "description": " ".join(rng.choice(words) for _ in range(120)),
                       "link": "https://example.invalid/" + "x" * 64,
                       "tags": [rng.choice(words) for _ in range(8)]})
    target = gib * (1 << 30)
    per_shard = target / shards
    with conn.cursor() as c:
        for s in range(shards):
            db = f"db{s:05d}"
            c.execute(f"INSERT INTO {db}.pins (body) VALUES " + ",".join(["(%s)"] * 512),
                      [body] * 512)
            c.execute(f"INSERT INTO {db}.board_has_pins (from_id, to_id, sequence) "
                      f"SELECT 1, local_id, local_id FROM {db}.pins")
            rows = 512
            while rows * (len(body) + 120) < per_shard:
                c.execute(f"INSERT INTO {db}.pins (body) SELECT body FROM {db}.pins "
                          f"LIMIT {min(rows, 1 << 20)}")
                rows += min(rows, 1 << 20)
            c.execute(f"INSERT IGNORE INTO {db}.board_has_pins (from_id, to_id, sequence) "
                      f"SELECT local_id % 1000, local_id, local_id FROM {db}.pins")
            print(f"  generated {db}: {rows} pins", flush=True)
    conn.close()
    return du(src.datadir)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def mbps(n: int, s: float) -> str:
    return f"{n / s / 1e6:.0f} MB/s" if s > 0 else "-"


def raw_limit(src: MariaDBServer, work: Path, cnf: str) -> tuple[float, float, int]:
    dest = work / "raw"
    dest.mkdir()
    argv = physical.backup_argv(defaults_file=cnf, datadir=str(src.datadir),
                                socket_path=str(src.socket), parallel=4)
    t0 = time.monotonic()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as b:
        x = subprocess.run(["mbstream", "-x", "-C", str(dest)], stdin=b.stdout, check=False)
    assert b.returncode == 0 and x.returncode == 0, (b.returncode, x.returncode)
    t1 = time.monotonic()
    physical.prepare(str(dest))
    t2 = time.monotonic()
    n = du(dest)
    shutil.rmtree(dest)
    return t1 - t0, t2 - t1, n


def physical_path(src: MariaDBServer, work: Path, cnf: str, compress: bool
                  ) -> tuple[float, float, int, Path]:
    dest = work / ("phys-z" if compress else "phys")
    rx = physical.Receiver("bench-secret", bind="127.0.0.1")
    got: dict[str, object] = {}
    t = threading.Thread(target=lambda: got.update(r=rx.receive(str(dest), timeout=7200)))
    argv = physical.backup_argv(defaults_file=cnf, datadir=str(src.datadir),
                                socket_path=str(src.socket), parallel=4)
    t0 = time.monotonic()
    t.start()
    sent = physical.send(f"127.0.0.1:{rx.port}", "bench-secret", argv, compress=compress)
    t.join()
    rx.close()
    t1 = time.monotonic()
    n = du(dest)  # what arrived, comparable with the raw limit's extracted bytes
    physical.prepare(str(dest))
    t2 = time.monotonic()
    return t1 - t0, t2 - t1, (sent.bytes if compress else n), dest


def s3_paths(src: MariaDBServer, dst: MariaDBServer, base: Path, cnf: str,
             raw: float) -> None:
    """Backup of *src* to moto's S3 and its restore into *dst*, each timed against the
    raw limit's *raw* seconds, and the S3 server's own rate for as many bytes."""
    from shardfleet import backup
    from tests.integration.s3_fixtures import moto_s3

    work = base / "moto"
    work.mkdir()
    with moto_s3("127.0.0.1", work, timeout=60) as server:
        s3 = backup.s3_client(endpoint_url=server.url, region="us-east-1",
                              access_key="testing", secret_key="testing")
        s3.create_bucket(Bucket="bench")
        loc = backup.Location("bench", "bench", "pair001")
        argv = physical.backup_argv(defaults_file=cnf, datadir=str(src.datadir),
                                    socket_path=str(src.socket), parallel=4)
        t0 = time.monotonic()
        manifest = backup.backup(s3, loc, argv, connect=src.connect, node=src.address,
                                 allow_master=True)
        bs = time.monotonic() - t0
        n = int(manifest.get("bytes") or 0)
        t0 = time.monotonic()
        backup.restore(s3, loc, datadir=str(dst.datadir), stop=dst.stop, start=dst.start,
                       connect=dst.connect, allow_master=True)
        rs = time.monotonic() - t0
        up, down = s3_rate(s3, n)
        print(f"backup to S3: {bs:.1f}s ({mbps(n, bs)}) = {bs / raw:.2f}x the raw limit "
              f"(goal <= 1.5x) {'OK' if bs / raw <= 1.5 else 'MISSED'}")
        print(f"restore     : {rs:.1f}s ({mbps(n, rs)}; download, sha256, prepare, install, "
              f"verify) = {rs / raw:.2f}x the raw limit (goal <= 1.5x) "
              f"{'OK' if rs / raw <= 1.5 else 'MISSED'}")
        print(f"  moto's S3 alone, {n / 2**20:.0f} MiB: multipart upload {up:.1f}s "
              f"({mbps(n, up)}), download {down:.1f}s ({mbps(n, down)}); backup / upload "
              f"alone = {bs / up:.2f}x, restore / download alone = {rs / down:.2f}x")


def s3_rate(s3: object, n: int) -> tuple[float, float]:
    """Seconds to upload *n* bytes from memory with multipart, and to download them."""
    import io

    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_chunksize=64 << 20, multipart_threshold=64 << 20)
    block = os.urandom(1 << 20)

    class Source(io.RawIOBase):
        left = n

        def readable(self) -> bool:
            return True

        def readinto(self, b: bytearray) -> int:  # type: ignore[override]
            k = min(len(b), self.left, len(block))
            b[:k] = block[:k]
            self.left -= k
            return k

    t0 = time.monotonic()
    s3.upload_fileobj(io.BufferedReader(Source(), 1 << 20), "bench", "rate",  # type: ignore[attr-defined]
                      Config=cfg)
    up = time.monotonic() - t0
    t0 = time.monotonic()
    body = s3.get_object(Bucket="bench", Key="rate")["Body"]  # type: ignore[attr-defined]
    while body.read(8 << 20):
        pass
    return up, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="data to generate (default 4 GiB)")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--no-logical", action="store_true", help="skip the (slow) logical path")
    ap.add_argument("--no-s3", action="store_true", help="skip the backup and restore")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sf-bench-copy-"))
    src, dst = server(base, 1), server(base, 2)
    try:
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            cnf = physical.client_defaults(tmp, "root", MariaDBServer.root_password)
            print(f"generating about {args.gib} GiB over {args.shards} shards ...", flush=True)
            size = generate(src, args.shards, args.gib)
            src.sql("FLUSH TABLES")
            print(f"source data directory: {size / 2**30:.2f} GiB")
            work = base / "work"
            work.mkdir()
            rs, rp, rn = raw_limit(src, work, cnf)
            print(f"raw limit   : stream {rs:.1f}s ({mbps(rn, rs)}), prepare {rp:.1f}s, "
                  f"total {rs + rp:.1f}s")
            ps, pp, pn, dest = physical_path(src, work, cnf, compress=False)
            print(f"physical    : stream {ps:.1f}s ({mbps(pn, ps)}), prepare {pp:.1f}s, "
                  f"total {ps + pp:.1f}s = {(ps + pp) / (rs + rp):.2f}x the raw limit "
                  f"(goal <= 1.2x)")
            t0 = time.monotonic()
            physical.install(str(dest), str(dst.datadir), stop=dst.stop, start=dst.start)
            print(f"  install into the stopped server and start it: "
                  f"{time.monotonic() - t0:.1f}s")
            zs, zp, zn, zdest = physical_path(src, work, cnf, compress=True)
            shutil.rmtree(zdest)
            print(f"physical+zstd: stream {zs:.1f}s ({zn / 2**20:.0f} MiB on the wire, "
                  f"{zn / max(pn, 1):.2f} of the extracted bytes), prepare {zp:.1f}s, total "
                  f"{zs + zp:.1f}s = {(zs + zp) / (rs + rp):.2f}x the raw limit")
            if not args.no_s3:
                s3_paths(src, dst, base, cnf, rs + rp)
            if not args.no_logical:
                dbs = [f"db{s:05d}" for s in range(args.shards)]
                logical_dst = server(base, 3)
                try:
                    opts = promote.Options(user="root", password=MariaDBServer.root_password)
                    t0 = time.monotonic()
                    promote.copy_shards(src.address, logical_dst.address, dbs, opts)
                    ls = time.monotonic() - t0
                finally:
                    logical_dst.stop(remove=True)
                print(f"logical     : {ls:.1f}s = {ls / (ps + pp):.1f}x the physical path "
                      f"(goal >= 5x)")
    finally:
        for s in (src, dst):
            s.stop(remove=True)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
