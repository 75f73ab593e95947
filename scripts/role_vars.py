#!/usr/bin/env python3
"""The README's role variable tables, generated from each role's defaults/main.yml.

Each public variable has a one-line comment above it in defaults/main.yml; that
comment is its description. `--write` refreshes README.md between the markers;
the unit tier checks the README is up to date.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- role-vars:begin -->", "<!-- role-vars:end -->"
ORDER = ["mysql", "zookeeper", "redis", "memcached", "shards", "ec2_fleet"]


def role_table(role: Path) -> str:
    lines = (role / "defaults" / "main.yml").read_text().splitlines()
    rows, comment = [], []
    for i, line in enumerate(lines):
        if line.startswith("#"):
            comment.append(line.lstrip("# ").strip())
            continue
        m = re.match(r"^([a-z][a-z0-9_]*):\s*(.*)$", line)
        if m:
            name, value = m.groups()
            if value in (">-", "|", ">", "|-") or value == "":
                value = "(see defaults)" if value else _block(lines, i)
            value = value if len(value) <= 60 else value[:57] + "..."
            desc = " ".join(comment) or "-"
            cell = value.replace("|", "\\|")
            rows.append(f"| `{name}` | `{cell}` | {desc} |")
        if not line.startswith("#"):
            comment = []
    head = (f"#### `{role.name}`\n\n| variable | default | meaning |\n| --- | --- | --- |\n")
    return head + "\n".join(rows) + "\n"


def _block(lines: list[str], i: int) -> str:
    nxt = [ln.strip() for ln in lines[i + 1:i + 4] if ln.startswith("  ")]
    return (" ".join(nxt)[:57] + "...") if nxt else "(empty)"


def tables() -> str:
    roles = [ROOT / "roles" / r for r in ORDER if (ROOT / "roles" / r / "defaults").exists()]
    roles += sorted(p for p in (ROOT / "roles").iterdir()
                    if p.is_dir() and p.name not in ORDER and (p / "defaults").exists())
    return "\n".join(role_table(r) for r in roles)


def render(readme: str) -> str:
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + tables() + readme[end:]


def main() -> int:
    readme = (ROOT / "README.md").read_text()
    new = render(readme)
    if "--write" in sys.argv:
        (ROOT / "README.md").write_text(new)
        return 0
    if new != readme:
        print("README.md role variable tables are stale: run scripts/role_vars.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
