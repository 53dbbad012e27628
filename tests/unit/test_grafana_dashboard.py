"""deploy/grafana/gpusched-dashboard.json (docs/operations.md, "Grafana"): every panel's PromQL
names only metrics the platform exports, parses (promtool's PromQL parser, where promtool can be
installed), and every panel has a title, a unit and a legend; the data source is the
``${DS_PROMETHEUS}`` template variable.

The exported names come from the code: every module of services/, runtime/ and gpusched/ that
uses prometheus_client is imported and the default registry's families are read, plus the
accounting service's read-model families (:func:`services.accounting.metrics.families`); a
counter's samples end in ``_total``, a histogram's in ``_bucket``/``_sum``/``_count``, a summary's
in ``_sum``/``_count``."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "gpusched-dashboard.json"
DS = "${DS_PROMETHEUS}"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",),
            "stateset": ("",), "unknown": ("",)}
# PromQL words that look like names: aggregations, functions (always followed by "(" and so left
# out anyway), keywords.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def exporting_modules() -> list[str]:
    """Modules of services/, runtime/ and gpusched/ that define metrics with prometheus_client."""
    out = []
    for root in ("services", "runtime", "gpusched"):
        for path in sorted((REPO / root).rglob("*.py")):
            if "prometheus_client" in path.read_text():
                out.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return out


def exported() -> set[str]:
    from prometheus_client import REGISTRY

    from services.accounting import metrics

    for module in exporting_modules():
        importlib.import_module(module)
    families = list(REGISTRY.collect()) + metrics.families([])
    return {f.name + suffix for f in families for suffix in SUFFIXES[f.type]}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (Grafana variables allowed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        if m.group(2) is None and m.group(1) not in KEYWORDS:
            names.add(m.group(1))
    return names


def data_panels(dashboard: dict) -> list[dict]:
    """Every panel that queries (rows hold none), nested ones included."""
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            assert not panel.get("targets"), f"row {panel['title']!r} has queries"
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("expr, names", [
    ('gpusched_gpu_allocated{flavor=~"$flavor"}', {"gpusched_gpu_allocated"}),
    ('sum by (team, flavor) (rate(a_total{x="by (y)"}[$__rate_interval])) / on (team) group_left b', {"a_total", "b"}),
    ("histogram_quantile(0.95, sum by (le) (rate(c_bucket[5m])))", {"c_bucket"}),
    ("max without (node) (d) > bool 0.5 or e offset 1h", {"d", "e"}),
    ("sum(f) / 3600", {"f"}),
])
def test_metric_names_of_an_expression(expr, names):
    assert metric_names(expr) == names


def test_the_exported_names_come_from_the_code():
    names = exported()
    assert {"gpusched_gpu_allocated", "gpusched_team_gpu_allocated", "gpusched_gpu_utilization_measured_ratio",
            "gpusched_gpu_utilization_simulated_ratio", "gpusched_scheduler_fragmentation_ratio",
            "gpusched_decisions_total", "gpusched_queue_wait_seconds_count", "gpusched_api_request_seconds_bucket"} <= names
    assert "gpusched_decisions" not in names  # a counter's samples end in _total


def test_every_query_names_an_exported_metric(dashboard):
    names = exported()
    panels = data_panels(dashboard)
    assert len(panels) >= 12
    unknown = {}
    for panel in panels:
        assert panel.get("targets"), f"panel {panel.get('title')!r} has no query"
        for target in panel["targets"]:
            used = metric_names(target["expr"])
            assert used, f"panel {panel['title']!r}: {target['expr']!r} names no metric"
            if missing := used - names:
                unknown[panel["title"]] = sorted(missing)
    assert unknown == {}, f"metrics the platform does not export: {unknown}"


def test_every_panel_has_a_title_a_unit_and_a_legend(dashboard):
    for panel in data_panels(dashboard):
        title = panel.get("title", "").strip()
        assert title, f"panel {panel.get('id')} has no title"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"
        legend = panel.get("options", {}).get("legend", {})
        assert legend.get("showLegend") is True and legend.get("displayMode") in ("list", "table"), \
            f"{title}: no legend shown"
        for target in panel["targets"]:
            assert target.get("legendFormat", "").strip() not in ("", "__auto"), f"{title}: a series has no legend"


def test_the_data_source_is_a_template_variable(dashboard):
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 39
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for panel in data_panels(dashboard):
        assert panel["datasource"]["uid"] == DS, panel["title"]
        assert all(t["datasource"]["uid"] == DS for t in panel["targets"]), panel["title"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == DS
            assert metric_names(re.sub(r"label_values\((\w+),.*", r"\1", v["query"]["query"])) <= exported()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_query_parses(dashboard, tmp_path):
    """promtool's PromQL parser, on each expression with the Grafana variables filled in."""
    from tests.integration.test_accounting_ledger import promtool

    tool = promtool()
    rules = []
    for panel in data_panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "5m")
            expr = re.sub(r"\$\w+", ".*", expr)
            rules.append({"record": f"dashboard:panel{panel['id']}:{target['refId'].lower()}", "expr": expr})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
