"""compose's Prometheus scrapes every Tangram service on the port its ops endpoint listens on,
and the provisioned Grafana dashboard queries only metrics that ``tangram.metrics`` defines.

Compose cannot run here (no registry); the files are checked as data, with no compose tool."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tangram import metrics

COMPOSE = Path(__file__).parents[2] / "compose"
TANGRAM_SERVICES = ("gateway", "scheduler", "cpu_manager", "quota_manager", "gpu_manager")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE / "docker-compose.yml")["services"]


def defined_metric_names() -> set[str]:
    """Every family name tangram.metrics defines: the registry's and the scrape-time ones."""
    names = {m.name for m in metrics.REGISTRY.collect()}
    state = [
        *metrics.queue_families({}, {}),
        *metrics.unit_families([], "allocated"),
        *metrics.unit_families([], "busy"),
        *metrics.quota_families([]),
    ]
    return names | {m.name for m in state}


def test_every_tangram_service_serves_its_ops_endpoint_on_the_scraped_port(
    compose: dict[str, Any],
):
    scrape = load_yaml(COMPOSE / "prometheus" / "prometheus.yml")["scrape_configs"]
    (sd,) = [c for job in scrape for c in job.get("dns_sd_configs", [])]
    assert set(sd["names"]) == set(TANGRAM_SERVICES)
    for name in TANGRAM_SERVICES:
        env = compose[name]["environment"]
        assert env["TANGRAM_OPS_HOST"] == "0.0.0.0", name  # loopback is unreachable from Prometheus
        assert int(env["TANGRAM_OPS_PORT"]) == sd["port"], name


def test_prometheus_and_grafana_mount_the_repos_files(compose: dict[str, Any]):
    prom = compose["prometheus"]
    assert "--enable-feature=exemplar-storage" in prom["command"]
    for service in ("prometheus", "grafana"):
        for volume in compose[service]["volumes"]:
            source = volume.split(":")[0]
            assert (COMPOSE / source).exists(), (service, source)
    sources = load_yaml(COMPOSE / "grafana/provisioning/datasources/datasources.yml")
    (prometheus,) = [d for d in sources["datasources"] if d["type"] == "prometheus"]
    assert prometheus["url"] == "http://prometheus:9090"
    (link,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == "trace_id"  # the exemplar label tangram.metrics writes
    assert link["datasourceUid"] in {d["uid"] for d in sources["datasources"]}
    providers = load_yaml(COMPOSE / "grafana/provisioning/dashboards/dashboards.yml")
    (provider,) = providers["providers"]
    mounted = next(v for v in compose["grafana"]["volumes"] if "dashboards:" in v)
    assert provider["options"]["path"] == mounted.split(":")[1]


def test_the_dashboard_queries_only_defined_metrics():
    dash = json.loads((COMPOSE / "grafana/dashboards/tangram.json").read_text())
    assert dash["uid"]
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|sum|count)$", "", n) for e in exprs for n in _names(e)}
    assert used - defined_metric_names() == set()
    assert {"tangram_actions", "tangram_act_seconds", "tangram_act_part_seconds"} <= used
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {"prometheus"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def _names(expr: str) -> set[str]:
    return set(re.findall(r"\btangram_[a-z_]+", expr))


def test_a_dashboard_naming_an_undefined_metric_is_caught():
    used = {
        re.sub(r"_(total|bucket|sum|count)$", "", n) for n in _names("rate(tangram_nope_total[1m])")
    }
    assert used - defined_metric_names() == {"tangram_nope"}
