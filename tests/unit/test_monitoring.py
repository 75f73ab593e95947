"""The monitoring role's files against the library and the docs (the lint tier runs this;
promtool checks and tests the rules themselves): the dashboard is JSON Grafana imports and
every query names a series the library serves or a rule records; every alert names the
exporter's metrics and a runbook section that exists."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from shardfleet import metrics

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "roles" / "monitoring" / "files"
RULES = FILES / "rules" / "shardfleet.rules.yml"
DASHBOARD = FILES / "dashboards" / "shardfleet.json"
# Prometheus's own series: a target's scrape result and the alerts the rules raise
BUILTIN = {"up", "ALERTS"}


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def recorded() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def series_names(expr: str) -> set[str]:
    """The metric names an expression reads: the library's (shardfleet_…), the rules'
    (shardfleet:…) and Prometheus's own, with quoted label values left out."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return set(re.findall(r"(?<![\w:])(shardfleet[\w:]*|up|ALERTS)(?![\w:(])", bare))


def known() -> set[str]:
    return set(metrics.METRICS) | recorded() | BUILTIN


def slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)}


def test_series_names_reads_metric_names_not_label_values_or_functions():
    assert series_names('sum by (cache) (rate(shardfleet_cache_requests_total{result="hit"}[5m]))'
                        ) == {"shardfleet_cache_requests_total"}
    assert series_names('up{job="shardfleet_x"} and shardfleet:a_b') == {"up", "shardfleet:a_b"}
    assert slug("1. Which case is it?") == "1-which-case-is-it"


def test_the_dashboard_is_importable_json_and_queries_known_series():
    dash = json.loads(DASHBOARD.read_text())
    assert dash.get("title") and dash.get("uid"), "a dashboard needs a title and a uid"
    assert [i["pluginId"] for i in dash["__inputs"]] == ["prometheus"], \
        "import asks for one Prometheus data source (DS_PROMETHEUS)"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    queries = [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row"
               for t in p["targets"]]
    assert len(queries) >= 10
    for title, expr in queries:
        names = series_names(expr)
        assert names, f"panel {title!r}: {expr!r} names no shardfleet series"
        unknown = names - known()
        assert not unknown, (f"panel {title!r} queries {sorted(unknown)}: neither "
                             "shardfleet.metrics.METRICS nor a recording rule has them")
    shown = set().union(*(series_names(e) for _, e in queries))
    for family in ("shardfleet_pair_writable_nodes", "shardfleet_ranges",
                   "shardfleet_replication_running", "shardfleet_operations_in_flight"):
        assert family in shown, f"the dashboard shows no {family}"


def test_every_alert_reads_served_series_and_names_an_existing_runbook_section():
    alerts = [r for r in rules() if "alert" in r]
    assert len(alerts) >= 12
    for r in rules():
        names = series_names(r["expr"])
        assert names, f"{r.get('alert') or r.get('record')}: names no series"
        unknown = names - known()
        assert not unknown, f"{r.get('alert') or r.get('record')} reads unknown {sorted(unknown)}"
    doc = (ROOT / "docs" / "monitoring.md").read_text()
    for r in alerts:
        link = r["annotations"].get("runbook", "")
        path, _, anchor = link.partition("#")
        assert path.startswith("docs/") and anchor, \
            f"{r['alert']}: runbook {link!r} is not file#section"
        assert (ROOT / path).is_file(), f"{r['alert']}: runbook file {path} does not exist"
        assert anchor in anchors(ROOT / path), f"{r['alert']}: {path} has no section #{anchor}"
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert f"`{r['alert']}`" in doc or f"### {r['alert']}" in doc, \
            f"docs/monitoring.md does not explain {r['alert']}"


def test_the_monitoring_doc_links_to_runbook_sections_that_exist():
    doc = ROOT / "docs" / "monitoring.md"
    links = re.findall(r"\]\((runbooks/[\w.-]+\.md)#([\w-]+)\)", doc.read_text())
    assert links, "docs/monitoring.md points to no runbook step"
    for path, anchor in links:
        assert anchor in anchors(doc.parent / path), \
            f"docs/monitoring.md: {path}#{anchor} does not exist"
