"""The deployment files fit together: compose services, ports, mounted files, the Prometheus
targets and the Grafana provisioning describe one and the same cluster."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from dashboard_helpers import count_expr_keys, dashboard_queries, load_dashboard

from pd_router.cli.main import config_from_argv

yaml = pytest.importorskip("yaml", reason="PyYAML (test extra) parses the compose files")

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
CONFIGS = ROOT / "configs"
WORKER_SERVICES = {
    "prefill-0": "prefill",
    "prefill-1": "prefill",
    "decode-0": "decode",
    "decode-1": "decode",
}
EXPECTED_SERVICES = {*WORKER_SERVICES, "router", "prometheus", "grafana"}
WORKER_START_TIMEOUT_SECS = 20.0


def load_yaml(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module", params=["compose.demo.yml", "compose.gpu.yml"])
def compose(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_yaml(DOCKER / request.param)


def tokens(command: list[str] | str) -> list[str]:
    """A compose command as separate tokens, ``--flag=value`` split into flag and value."""
    parts = command.split() if isinstance(command, str) else [str(c) for c in command]
    out: list[str] = []
    for part in parts:
        if part.startswith("--") and "=" in part:
            out.extend(part.split("=", 1))
        else:
            out.append(part)
    return out


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def host_path(compose_file_dir: Path, volume: str) -> Path:
    source = volume.split(":", 1)[0]
    return (compose_file_dir / source).resolve()


def published_host_ports(service: dict[str, Any]) -> list[int]:
    return [int(str(p).split(":")[-2]) for p in service.get("ports", [])]


def worker_url_port(service: dict[str, Any]) -> int:
    args = tokens(service["command"])
    return int(flag(args, "--port"))


def scrape_targets(path: Path) -> dict[str, list[str]]:
    config = load_yaml(path)
    return {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }


def test_each_compose_file_runs_router_two_prefill_two_decode_prometheus_grafana(compose):
    assert set(compose["services"]) == EXPECTED_SERVICES


def test_every_built_image_uses_a_dockerfile_that_exists(compose):
    for name, service in compose["services"].items():
        build = service.get("build")
        if build is None:
            assert "image" in service, f"{name} has neither build nor image"
            continue
        context = (DOCKER / build["context"]).resolve()
        assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']} missing"


def test_every_mounted_config_file_exists(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith((".", "/")) and "$" not in source:
                assert host_path(DOCKER, volume).exists(), f"{name}: {source} does not exist"


def test_published_host_ports_are_distinct(compose):
    ports = [p for s in compose["services"].values() for p in published_host_ports(s)]
    assert len(ports) == len(set(ports))


def test_prometheus_and_grafana_are_published_on_their_usual_ports(compose):
    assert published_host_ports(compose["services"]["prometheus"]) == [9090]
    assert published_host_ports(compose["services"]["grafana"]) == [3000]


def test_prometheus_loads_the_alert_rules_next_to_its_config(compose):
    prometheus = compose["services"]["prometheus"]
    mounts = {v.split(":")[1]: host_path(DOCKER, v) for v in prometheus["volumes"]}
    config = load_yaml(mounts["/etc/prometheus/prometheus.yml"])
    for rule_file in config["rule_files"]:
        mounted = mounts[str(Path("/etc/prometheus") / rule_file)]
        assert mounted == (CONFIGS / "alerts.yml").resolve()


def test_grafana_mounts_the_provisioning_and_the_dashboard_folder_it_names(compose):
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: host_path(DOCKER, v) for v in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    provider = load_yaml(provisioning / "dashboards" / "pd-router.yml")["providers"][0]
    dashboards = mounts[provider["options"]["path"]]
    assert (dashboards / "pd-router.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/pd-router.json"


def test_grafana_datasource_is_the_compose_prometheus(compose):
    datasource = load_yaml(CONFIGS / "grafana" / "provisioning" / "datasources" / "prometheus.yml")[
        "datasources"
    ][0]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    assert "prometheus" in compose["services"]
    assert "network_mode" not in compose["services"]["prometheus"]


def test_dashboard_json_asks_for_a_prometheus_datasource():
    dashboard = json.loads((CONFIGS / "grafana" / "dashboards" / "pd-router.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_panels_have_unique_ids_and_do_not_overlap():
    panels = json.loads((CONFIGS / "grafana" / "dashboards" / "pd-router.json").read_text())[
        "panels"
    ]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_demo_workers_are_reference_workers_with_role_switch_on_port_30000():
    services = load_yaml(DOCKER / "compose.demo.yml")["services"]
    for name, role in WORKER_SERVICES.items():
        service = services[name]
        args = tokens(service["command"])
        assert service["entrypoint"] == ["pd-worker"]
        assert args[0] == "serve"
        assert flag(args, "--role") == role
        assert flag(args, "--host") == "0.0.0.0"
        assert worker_url_port(service) == 30000
        assert "--enable-pd-role-switch" in args


def test_demo_router_lists_every_worker_in_its_pool_and_is_published():
    services = load_yaml(DOCKER / "compose.demo.yml")["services"]
    args = tokens(services["router"]["command"])
    for name, role in WORKER_SERVICES.items():
        url = f"http://{name}:30000"
        assert args[args.index(url) - 1] == f"--{role}", url
    port = int(flag(args, "--port"))
    assert published_host_ports(services["router"]) == [port]


def test_demo_prometheus_scrapes_the_router_and_every_worker_service():
    services = load_yaml(DOCKER / "compose.demo.yml")["services"]
    targets = scrape_targets(CONFIGS / "prometheus.yml")
    router_port = flag(tokens(services["router"]["command"]), "--port")
    assert targets["pd-router"] == [f"router:{router_port}"]
    assert sorted(targets["pd-workers"]) == sorted(f"{name}:30000" for name in WORKER_SERVICES)


def test_gpu_workers_launch_sglang_through_server_patch_with_mooncake():
    services = load_yaml(DOCKER / "compose.gpu.yml")["services"]
    for name, role in WORKER_SERVICES.items():
        service = services[name]
        args = tokens(service["command"])
        assert service["entrypoint"] == ["python3", "-m", "server_patch.launch_server"]
        assert service["build"]["dockerfile"] == "docker/Dockerfile.sglang"
        assert flag(args, "--disaggregation-mode") == role
        assert flag(args, "--disaggregation-transfer-backend") == "mooncake"
        assert "--enable-pd-role-switch" in args
        assert "--enable-metrics" in args
        assert service["network_mode"] == "host"


def test_gpu_workers_have_distinct_ports_bootstrap_ports_and_gpus():
    services = load_yaml(DOCKER / "compose.gpu.yml")["services"]
    ports, bootstrap_ports, gpus = set(), set(), set()
    for name in WORKER_SERVICES:
        service = services[name]
        args = tokens(service["command"])
        ports.add(int(flag(args, "--port")))
        bootstrap_ports.add(int(flag(args, "--disaggregation-bootstrap-port")))
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        gpus.update(device["device_ids"])
    assert len(ports) == len(bootstrap_ports) == len(gpus) == len(WORKER_SERVICES)
    assert not ports & bootstrap_ports


def test_gpu_router_lists_every_worker_on_its_host_port():
    services = load_yaml(DOCKER / "compose.gpu.yml")["services"]
    args = tokens(services["router"]["command"])
    for name, role in WORKER_SERVICES.items():
        port = worker_url_port(services[name])
        url = f"http://127.0.0.1:{port}"
        assert args[args.index(url) - 1] == f"--{role}", url


def test_gpu_prometheus_scrapes_the_host_network_services_through_the_host_gateway():
    services = load_yaml(DOCKER / "compose.gpu.yml")["services"]
    targets = scrape_targets(CONFIGS / "prometheus.gpu.yml")
    router_port = flag(tokens(services["router"]["command"]), "--port")
    assert targets["pd-router"] == [f"host.docker.internal:{router_port}"]
    worker_ports = sorted(worker_url_port(services[name]) for name in WORKER_SERVICES)
    assert sorted(int(t.rsplit(":", 1)[1]) for t in targets["pd-workers"]) == worker_ports
    assert "host.docker.internal:host-gateway" in services["prometheus"]["extra_hosts"]


def test_router_dockerfile_copies_only_files_that_exist():
    dockerfile = (DOCKER / "Dockerfile.router").read_text()
    sources = [
        source
        for line in dockerfile.splitlines()
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
    ]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
    assert re.search(r'^ENTRYPOINT \["pd-router"\]$', dockerfile, re.MULTILINE)


def test_router_command_of_each_compose_file_parses_to_its_two_pools(compose):
    services = compose["services"]
    config = config_from_argv([str(arg) for arg in services["router"]["command"]])
    on_host = services["router"].get("network_mode") == "host"
    expected: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for name, role in WORKER_SERVICES.items():
        port = worker_url_port(services[name])
        expected[role].add(f"http://{'127.0.0.1' if on_host else name}:{port}")
    assert {spec.url for spec in config.prefill} == expected["prefill"]
    assert {spec.url for spec in config.decode} == expected["decode"]
    assert config.host == "0.0.0.0"


@pytest.mark.parametrize("name", ["compose.demo.yml", "compose.gpu.yml", "compose.ha.yml"])
def test_every_compose_router_guards_its_admin_api_or_opens_it_on_purpose(name):
    services = load_yaml(DOCKER / name)["services"]
    for service in (s for n, s in services.items() if n.startswith("router")):
        keyed = "PD_ROUTER_ADMIN_KEY" in service.get("environment", {})
        assert keyed or "--allow-unauthenticated" in tokens(service["command"]), name


def test_demo_worker_command_starts_a_healthy_worker_in_its_role(free_port):
    service = load_yaml(DOCKER / "compose.demo.yml")["services"]["prefill-0"]
    args = [str(a) for a in service["command"]]
    port, bootstrap_port = free_port(), free_port()
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    args[args.index("--bootstrap-port") + 1] = str(bootstrap_port)
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("pd-worker")), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        info = wait_for_server_info(f"http://127.0.0.1:{port}", process)
    finally:
        process.terminate()
        process.wait(10)
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == bootstrap_port
    assert info["enable_pd_role_switch"] is True


def wait_for_server_info(url: str, process: subprocess.Popen) -> dict[str, Any]:
    deadline = time.monotonic() + WORKER_START_TIMEOUT_SECS
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if client.get(url + "/health").status_code == 200:
                    return client.get(url + "/server_info").json()
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise AssertionError(f"worker at {url} not healthy (exit code {process.poll()})")


def test_query_walker_finds_every_expr_of_the_shipped_dashboard():
    dashboard = load_dashboard()
    found = [w for w, _ in dashboard_queries(dashboard) if not w.startswith("variable ")]
    assert len(found) == count_expr_keys(dashboard)


def test_query_walker_reads_nested_row_panels_annotations_and_query_variables():
    dashboard = {
        "annotations": {"list": [{"name": "marks", "expr": "a_total"}]},
        "templating": {
            "list": [
                {"name": "ds", "type": "datasource", "query": "prometheus"},
                {"name": "worker", "type": "query", "query": "label_values(b_state, worker)"},
                {"name": "role", "type": "query", "query": {"query": "label_values(role)"}},
                {"name": "top", "type": "query", "query": {"query": "query_result(topk(1, c))"}},
            ]
        },
        "panels": [
            {"title": "open", "targets": [{"refId": "A", "expr": "d"}]},
            {
                "title": "collapsed row",
                "type": "row",
                "panels": [{"title": "inner", "targets": [{"refId": "A", "expr": "e"}]}],
            },
        ],
    }
    assert sorted(expr for _, expr in dashboard_queries(dashboard)) == [
        "a_total", "b_state", "d", "e", "topk(1, c)"
    ]  # fmt: skip


# --- docker/compose.ha.yml: replicas on etcd behind HAProxy ----------------------------------


@pytest.fixture(scope="module")
def ha() -> dict[str, Any]:
    return load_yaml(DOCKER / "compose.ha.yml")["services"]


def ha_routers(services: dict[str, Any]) -> list[str]:
    return sorted(name for name in services if name.startswith("router-"))


def test_ha_replicas_join_one_cluster_on_the_compose_etcd_without_a_worker_list(ha):
    assert len(ha_routers(ha)) >= 2
    for name in ha_routers(ha):
        config = config_from_argv([str(arg) for arg in ha[name]["command"]])
        assert (config.cluster.etcd, config.cluster.name) == (("http://etcd:2379",), "demo")
        assert (config.prefill, config.decode) == ((), ())


def test_ha_workers_register_in_that_cluster_under_their_service_name(ha):
    for name, role in WORKER_SERVICES.items():
        args = tokens(ha[name]["command"])
        assert (flag(args, "--role"), flag(args, "--etcd"), flag(args, "--cluster")) == (
            role, "http://etcd:2379", "demo",
        )  # fmt: skip
        assert flag(args, "--advertise-url") == f"http://{name}:{flag(args, '--port')}"


def test_ha_balancer_checks_the_readiness_of_every_replica_and_nothing_else():
    cfg = (DOCKER / "haproxy.ha.cfg").read_text()
    servers = re.findall(r"^\s*server (\S+) (\S+):(\d+)", cfg, re.MULTILINE)
    services = load_yaml(DOCKER / "compose.ha.yml")["services"]
    assert sorted(name for name, _, _ in servers) == ha_routers(services)
    assert all(host == name and port == "8000" for name, host, port in servers)
    assert "http-check send meth GET uri /readiness" in cfg


def test_ha_balancer_config_is_the_file_the_compose_mounts(ha):
    mounts = [volume.split(":")[0] for volume in ha["lb"]["volumes"]]
    assert mounts == ["./haproxy.ha.cfg"]
    assert (DOCKER / mounts[0]).is_file()
