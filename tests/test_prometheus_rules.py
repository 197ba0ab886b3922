"""The PrometheusRule as Prometheus reads it: `promtool check rules`, and `promtool test rules` on every alert.

tests/prometheus_rules_test.yaml holds the unit tests (input series, the alerts expected with their labels and
rendered annotations, and healthy series that must stay quiet). promtool comes with Debian's `prometheus` package;
`make venv` installs it where it runs as root with apt. Skipped only where promtool is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RULE = ROOT / "deploy" / "components" / "monitoring" / "prometheusrule.yaml"
UNIT = Path(__file__).resolve().parent / "prometheus_rules_test.yaml"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus; `make venv` does it when root)"
)


def groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(RULE.read_text())["spec"]["groups"])


def rules() -> list[dict[str, Any]]:
    return [r for g in groups() for r in g["rules"]]


def promtool(tmp: Path, rule_groups: list[dict[str, Any]], *args: str) -> subprocess.CompletedProcess[str]:
    """promtool ARGS in tmp, with the rule groups written to rules.yaml and the unit tests beside them."""
    assert PROMTOOL is not None
    (tmp / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}, sort_keys=False))
    shutil.copy(UNIT, tmp / UNIT.name)
    return subprocess.run([PROMTOOL, *args], cwd=tmp, capture_output=True, text=True, timeout=120)


def test_check_rules(tmp_path: Path) -> None:
    res = promtool(tmp_path, groups(), "check", "rules", "rules.yaml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules())} rules found" in res.stdout


def test_every_alert_and_recording_rule_has_a_unit_test() -> None:
    unit = yaml.safe_load(UNIT.read_text())
    tested = {t["alertname"] for case in unit["tests"] for t in case.get("alert_rule_test", [])}
    fires = {t["alertname"] for case in unit["tests"] for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert tested == alerts and fires == alerts
    exprs = {t["expr"] for case in unit["tests"] for t in case.get("promql_expr_test", [])}
    assert {r["record"] for r in rules() if "record" in r} <= exprs


def test_unit_tests_pass(tmp_path: Path) -> None:
    res = promtool(tmp_path, groups(), "test", "rules", UNIT.name)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


@pytest.mark.parametrize("alert", sorted(r["alert"] for r in rules() if "alert" in r) if PROMTOOL else [])
def test_unit_tests_catch_an_alert_that_never_fires(alert: str, tmp_path: Path) -> None:
    broken = groups()
    for g in broken:
        for r in g["rules"]:
            if r.get("alert") == alert:
                r["expr"] = "vector(1) == 0"
    res = promtool(tmp_path, broken, "test", "rules", UNIT.name)
    assert res.returncode != 0 and alert in res.stdout + res.stderr, res.stdout + res.stderr
