"""The legacy single database: its schema, a generator, and a bounded live writer.

This is the shape a pre-sharding application typically has: one MariaDB
database, integer ``AUTO_INCREMENT`` keys and ordinary foreign keys::

    users(id) <-- boards(user_id) <-- pins(board_id, user_id)
    likes(user_id -> users, pin_id -> pins)          (a relation, no ID of its own)
    follows(follower_id -> users, followee_id -> users)

The generator fills it (deterministically for a seed) and :class:`LegacyWriter`
keeps writing to it (inserts, updates and deletes, bounded in count and time)
while a migration copies it: the live database the post migrated from.

Run ``python -m shardfleet.migrate.legacy --help`` to generate one by hand.
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import threading
import time
from datetime import datetime, timedelta
from typing import Any

log = logging.getLogger(__name__)

_IDENT = re.compile(r"^[a-z][a-z0-9_]{0,63}$")

LEGACY_DDL = {
    "users": """CREATE TABLE IF NOT EXISTS users (
  id INT UNSIGNED NOT NULL AUTO_INCREMENT,
  username VARCHAR(64) NOT NULL,
  email VARCHAR(255) NOT NULL,
  full_name VARCHAR(255) NOT NULL,
  about TEXT NULL,
  created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
  PRIMARY KEY (id),
  UNIQUE KEY username (username),
  UNIQUE KEY email (email)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    "boards": """CREATE TABLE IF NOT EXISTS boards (
  id INT UNSIGNED NOT NULL AUTO_INCREMENT,
  user_id INT UNSIGNED NOT NULL,
  name VARCHAR(255) NOT NULL,
  description TEXT NULL,
  category VARCHAR(64) NULL,
  created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
  PRIMARY KEY (id),
  KEY user_id (user_id),
  CONSTRAINT boards_user FOREIGN KEY (user_id) REFERENCES users (id) ON DELETE CASCADE
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    "pins": """CREATE TABLE IF NOT EXISTS pins (
  id INT UNSIGNED NOT NULL AUTO_INCREMENT,
  user_id INT UNSIGNED NOT NULL,
  board_id INT UNSIGNED NOT NULL,
  image_url VARCHAR(1024) NOT NULL,
  link VARCHAR(1024) NULL,
  description TEXT NULL,
  created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
  PRIMARY KEY (id),
  KEY user_id (user_id),
  KEY board_id (board_id),
  CONSTRAINT pins_user FOREIGN KEY (user_id) REFERENCES users (id) ON DELETE CASCADE,
  CONSTRAINT pins_board FOREIGN KEY (board_id) REFERENCES boards (id) ON DELETE CASCADE
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    "likes": """CREATE TABLE IF NOT EXISTS likes (
  user_id INT UNSIGNED NOT NULL,
  pin_id INT UNSIGNED NOT NULL,
  created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  PRIMARY KEY (user_id, pin_id),
  KEY pin_id (pin_id),
  CONSTRAINT likes_user FOREIGN KEY (user_id) REFERENCES users (id) ON DELETE CASCADE,
  CONSTRAINT likes_pin FOREIGN KEY (pin_id) REFERENCES pins (id) ON DELETE CASCADE
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    "follows": """CREATE TABLE IF NOT EXISTS follows (
  follower_id INT UNSIGNED NOT NULL,
  followee_id INT UNSIGNED NOT NULL,
  created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  PRIMARY KEY (follower_id, followee_id),
  KEY followee_id (followee_id),
  CONSTRAINT follows_follower FOREIGN KEY (follower_id) REFERENCES users (id) ON DELETE CASCADE,
  CONSTRAINT follows_followee FOREIGN KEY (followee_id) REFERENCES users (id) ON DELETE CASCADE
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
}

CATEGORIES = ["food", "travel", "diy", "fashion", "art", "garden", None]
WORDS = ("red blue quiet bright summer winter paper stone river cedar linen copper "
         "garden kitchen studio harbor meadow attic").split()


def ident(name: str, what: str = "database") -> str:
    """A database name from the command line, checked before it goes into SQL."""
    if not isinstance(name, str) or not _IDENT.match(name):
        from shardfleet.migrate.engine import BadName

        raise BadName(f"{what} name {name!r} is not valid (^[a-z][a-z0-9_]{{0,63}}$)")
    return name


def create_schema(conn: Any, db: str) -> None:
    db = ident(db)
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `{db}` CHARACTER SET utf8mb4")
        for ddl in LEGACY_DDL.values():
            cur.execute(ddl.replace("CREATE TABLE IF NOT EXISTS ",
                                    f"CREATE TABLE IF NOT EXISTS `{db}`.", 1))


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def generate(conn: Any, db: str, users: int = 10_000, *, seed: int = 1,
             batch: int = 2000) -> dict[str, int]:
    """Create *db* with the legacy schema and fill it: *users* users, 1-2 boards each,
    0-4 pins per board, 0-4 likes and 0-2 follows per user. Returns row counts."""
    db = ident(db)
    create_schema(conn, db)
    rng = random.Random(seed)
    start = datetime(2014, 1, 1)
    span = 365 * 24 * 3600

    def when() -> datetime:
        return start + timedelta(seconds=rng.randrange(span), microseconds=rng.randrange(10**6))

    rows: dict[str, list[tuple[Any, ...]]] = {t: [] for t in LEGACY_DDL}
    board_id = pin_id = 0
    pins_of: list[int] = []
    for u in range(1, users + 1):
        rows["users"].append((u, f"user{u}", f"user{u}@example.com", f"User {u} {_text(rng, 1)}",
                              _text(rng, rng.randrange(0, 8)) or None, when()))
        for _ in range(rng.randint(1, 2)):
            board_id += 1
            rows["boards"].append((board_id, u, _text(rng, 2).title(), _text(rng, 6),
                                   rng.choice(CATEGORIES), when()))
            for _ in range(rng.randint(0, 4)):
                pin_id += 1
                pins_of.append(pin_id)
                rows["pins"].append((pin_id, u, board_id,
                                     f"https://img.example.com/{pin_id}.jpg",
                                     f"https://example.com/{_text(rng, 1)}" if rng.random() < .5
                                     else None, _text(rng, rng.randrange(3, 12)), when()))
    for u in range(1, users + 1):
        if pins_of:
            for p in set(rng.choice(pins_of) for _ in range(rng.randint(0, 4))):
                rows["likes"].append((u, p, when()))
        for f in set(rng.randint(1, users) for _ in range(rng.randint(0, 2))):
            if f != u:
                rows["follows"].append((u, f, when()))
    sql = {
        "users": "INSERT INTO `{db}`.users (id, username, email, full_name, about, created_at) "
                 "VALUES (%s, %s, %s, %s, %s, %s)",
        "boards": "INSERT INTO `{db}`.boards (id, user_id, name, description, category, "
                  "created_at) VALUES (%s, %s, %s, %s, %s, %s)",
        "pins": "INSERT INTO `{db}`.pins (id, user_id, board_id, image_url, link, description, "
                "created_at) VALUES (%s, %s, %s, %s, %s, %s, %s)",
        "likes": "INSERT INTO `{db}`.likes (user_id, pin_id, created_at) VALUES (%s, %s, %s)",
        "follows": "INSERT INTO `{db}`.follows (follower_id, followee_id, created_at) "
                   "VALUES (%s, %s, %s)",
    }
    with conn.cursor() as cur:
        for table in LEGACY_DDL:  # parents first: the foreign keys are checked
            data = rows[table]
            for i in range(0, len(data), batch):
                cur.executemany(sql[table].format(db=db), data[i:i + batch])
    return {t: len(v) for t, v in rows.items()}


class LegacyWriter(threading.Thread):
    """Keeps writing to the legacy database, like its application would, until stopped.

    Bounded: at most *max_ops* operations and *max_seconds* seconds, with a pause
    of *pause* seconds between operations. Each operation is one of: a new user
    with a board and a pin, a new pin, an edited pin, a renamed board, a new or
    removed like, a deleted pin, an edited profile, a new follow.
    """

    def __init__(self, connect: Any, db: str, *, seed: int = 2, max_ops: int = 2000,
                 max_seconds: float = 30.0, pause: float = 0.002) -> None:
        super().__init__(name="legacy-writer", daemon=True)
        self.connect = connect
        self.db = ident(db)
        self.rng = random.Random(seed)
        self.max_ops, self.max_seconds, self.pause = max_ops, max_seconds, pause
        self.ops = 0
        self.counts: dict[str, int] = {}
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        conn = self.connect()
        deadline = time.monotonic() + self.max_seconds
        try:
            with conn.cursor() as cur:
                while (self.ops < self.max_ops and time.monotonic() < deadline
                       and not self._stop_event.is_set()):
                    op = self._one(cur)
                    self.counts[op] = self.counts.get(op, 0) + 1
                    self.ops += 1
                    if self.pause:
                        self._stop_event.wait(self.pause)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
            log.exception("legacy writer failed")
        finally:
            conn.close()

    def _pick(self, cur: Any, table: str) -> int | None:
        cur.execute(f"SELECT MAX(id) FROM `{self.db}`.{table}")
        top = cur.fetchone()[0]
        if not top:
            return None
        cur.execute(f"SELECT id FROM `{self.db}`.{table} WHERE id >= %s ORDER BY id LIMIT 1",
                    (self.rng.randint(1, int(top)),))
        row = cur.fetchone()
        return int(row[0]) if row else None

    def _one(self, cur: Any) -> str:
        rng, db = self.rng, self.db
        r = rng.random()
        if r < 0.15:
            tag = f"w{rng.getrandbits(40):x}"
            cur.execute(f"INSERT INTO `{db}`.users (username, email, full_name) VALUES "
                        "(%s, %s, %s)", (tag, f"{tag}@example.com", f"New {tag}"))
            user = cur.lastrowid
            cur.execute(f"INSERT INTO `{db}`.boards (user_id, name) VALUES (%s, %s)",
                        (user, "First board"))
            board = cur.lastrowid
            cur.execute(f"INSERT INTO `{db}`.pins (user_id, board_id, image_url) VALUES "
                        "(%s, %s, %s)", (user, board, f"https://img.example.com/{tag}.jpg"))
            return "new user"
        if r < 0.35:
            board = self._pick(cur, "boards")
            if board is None:
                return "noop"
            cur.execute(f"INSERT INTO `{db}`.pins (user_id, board_id, image_url, description) "
                        f"SELECT user_id, id, %s, %s FROM `{db}`.boards WHERE id=%s",
                        (f"https://img.example.com/n{rng.getrandbits(32)}.jpg",
                         _text(rng, 5), board))
            return "new pin"
        if r < 0.50:
            pin = self._pick(cur, "pins")
            cur.execute(f"UPDATE `{db}`.pins SET description=%s WHERE id=%s",
                        (_text(rng, 7), pin))
            return "edit pin"
        if r < 0.58:
            board = self._pick(cur, "boards")
            cur.execute(f"UPDATE `{db}`.boards SET name=%s WHERE id=%s",
                        (_text(rng, 2).title(), board))
            return "rename board"
        if r < 0.75:
            user, pin = self._pick(cur, "users"), self._pick(cur, "pins")
            if user is None or pin is None:
                return "noop"
            cur.execute(f"INSERT IGNORE INTO `{db}`.likes (user_id, pin_id) VALUES (%s, %s)",
                        (user, pin))
            return "like"
        if r < 0.82:
            cur.execute(f"DELETE FROM `{db}`.likes ORDER BY created_at DESC LIMIT 1")
            return "unlike"
        if r < 0.87:
            pin = self._pick(cur, "pins")
            cur.execute(f"DELETE FROM `{db}`.pins WHERE id=%s", (pin,))
            return "delete pin"
        if r < 0.94:
            user = self._pick(cur, "users")
            cur.execute(f"UPDATE `{db}`.users SET about=%s WHERE id=%s", (_text(rng, 9), user))
            return "edit profile"
        a, b = self._pick(cur, "users"), self._pick(cur, "users")
        if a is None or b is None or a == b:
            return "noop"
        cur.execute(f"INSERT IGNORE INTO `{db}`.follows (follower_id, followee_id) "
                    "VALUES (%s, %s)", (a, b))
        return "follow"


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - a manual tool
    import os

    import pymysql

    ap = argparse.ArgumentParser(description="Generate a legacy single database to migrate.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=3306)
    ap.add_argument("--user", default="root")
    ap.add_argument("--db", default="legacy")
    ap.add_argument("--users", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    conn = pymysql.connect(host=args.host, port=args.port, user=args.user,
                           password=os.environ.get("SHARDFLEET_LEGACY_PASSWORD", ""),
                           autocommit=True, charset="utf8mb4")
    counts = generate(conn, args.db, args.users, seed=args.seed)
    print(", ".join(f"{t} {n}" for t, n in counts.items()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
