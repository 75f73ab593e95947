#!/usr/bin/env python3
"""The README's role variable tables, generated from each role's meta/argument_specs.yml.

The spec is the one description of a role's inputs: Ansible validates them against it
when the role starts and `ansible-doc -t role` renders it. Each table row is one option
of the `main` entry point (variable, type, default, required/choices, meaning); a
default the spec leaves out because it is a Jinja expression is shown as written in
defaults/main.yml. Other entry points (`tasks_from`) are listed under the table.
`--write` refreshes README.md between the markers; without it the script fails when the
README is stale (the lint tier runs it so).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- role-vars:begin -->", "<!-- role-vars:end -->"
ORDER = ["mysql", "zookeeper", "redis", "memcached", "shards", "tls_cert", "ec2_fleet"]
WIDTH = 60  # longest default shown in a cell
# ansible-doc markup: C(code), I(italic), O(option), V(value)
MARKUP = re.compile(r"\b[CIOV]\(([^()]*)\)")


def specs(role: Path) -> dict[str, Any]:
    """The role's entry points: {name: entry point}."""
    data = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text()) or {}
    return dict(data.get("argument_specs") or {})


def defaults(role: Path) -> dict[str, Any]:
    path = role / "defaults" / "main.yml"
    return dict(yaml.safe_load(path.read_text()) or {}) if path.exists() else {}


def _text(description: str | list[str]) -> str:
    paragraphs = [description] if isinstance(description, str) else description
    text = " ".join(" ".join(p.split()) for p in paragraphs)
    return MARKUP.sub(lambda m: f"`{m.group(1)}`", text).replace("|", "\\|")


def _value(value: Any) -> str:
    """A value as YAML would write it inline."""
    if isinstance(value, str):
        return value if _plain(value) else json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_value(k)}: {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(value)  # bool, int, float, None: as YAML writes them


def _plain(text: str) -> bool:
    """Whether YAML reads *text* back unquoted as the same string."""
    if not text or text != text.strip() or text[0] in "{[&*!|>'\"%@`#,?:-" or "\n" in text:
        return False
    try:
        return bool(yaml.safe_load(text) == text)
    except yaml.YAMLError:
        return False


def _cell(value: Any) -> str:
    text = _value(value)
    text = text if len(text) <= WIDTH else text[:WIDTH - 3] + "..."
    return "`" + text.replace("|", "\\|") + "`"


def _type(option: dict[str, Any]) -> str:
    kind = option.get("type", "str")
    return f"list of {option['elements']}" if kind == "list" and "elements" in option else kind


def row(name: str, option: dict[str, Any], values: dict[str, Any]) -> str:
    if "default" in option:
        default = _cell(option["default"])
    elif name in values:
        default = _cell(values[name]) + " (computed)"
    else:
        default = "-"
    rules = []
    if option.get("required"):
        rules.append("required")
    if "choices" in option:
        rules.append("one of " + ", ".join(f"`{c}`" for c in option["choices"]))
    meaning = _text(option.get("description", "-"))
    if option.get("options"):
        meaning += " Keys: " + ", ".join(f"`{k}`" for k in option["options"]) + "."
    return f"| `{name}` | {_type(option)} | {default} | {'; '.join(rules) or '-'} | {meaning} |"


def role_table(role: Path) -> str:
    entries = specs(role)
    values = defaults(role)
    out = [f"#### `{role.name}`", "",
           "| variable | type | default | required / choices | meaning |",
           "| --- | --- | --- | --- | --- |"]
    out += [row(n, o, values) for n, o in (entries.get("main", {}).get("options") or {}).items()]
    for name, entry in entries.items():
        if name != "main":
            opts = ", ".join(f"`{o}`" for o in entry.get("options") or {}) or "none"
            out += ["", f"Entry point `{name}` (`tasks_from: {name}`): "
                        f"{_text(entry.get('short_description', ''))}; options {opts}."]
    return "\n".join(out) + "\n"


def roles() -> list[Path]:
    found = [p.parents[1] for p in sorted((ROOT / "roles").glob("*/meta/argument_specs.yml"))]
    return sorted(found, key=lambda p: (ORDER.index(p.name) if p.name in ORDER else len(ORDER),
                                        p.name))


def tables() -> str:
    return "\n".join(role_table(r) for r in roles())


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
        print("README.md role variable tables are stale: run scripts/role_docs.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
