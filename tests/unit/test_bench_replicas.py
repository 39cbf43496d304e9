"""The replica benchmarks' pure helpers: which router configurations a run compares, and the
command line that joins a pd-router to a cluster. Figures belong in docs/PERFORMANCE.md."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/ is a folder of scripts, not a package: make its modules importable."""
    monkeypatch.syspath_prepend(str(BENCH))


def test_router_counts_name_one_plain_router_and_replica_clusters(bench_modules: None) -> None:
    from replica_throughput import parse_configurations

    configurations = parse_configurations("1,2,3,2")
    assert [c.name for c in configurations] == ["1 router", "2 replicas", "3 replicas"]
    assert [c.cluster for c in configurations[1:]] == ["replicas-2", "replicas-3"]


@pytest.mark.parametrize("text", ["", "0", "1,9", "two"])
def test_router_counts_outside_one_to_eight_are_refused(bench_modules: None, text: str) -> None:
    from replica_throughput import parse_configurations

    with pytest.raises(ValueError):
        parse_configurations(text)


def test_a_replica_is_the_benchmarked_pd_router_joined_to_its_cluster(bench_modules: None) -> None:
    from peers import PEERS, Topology
    from replica_throughput import Configuration, router_peers

    topology = Topology(prefills=(("http://127.0.0.1:1", 2),), decodes=("http://127.0.0.1:3",))
    peers = router_peers(Configuration(2), "http://127.0.0.1:2379")
    plain = PEERS["pd-router"].argv(topology, "127.0.0.1", 8000)
    assert len({peer.name for peer in peers}) == 2
    for peer in peers:
        argv = peer.argv(topology, "127.0.0.1", 8000)
        assert argv == [*plain, "--etcd", "http://127.0.0.1:2379", "--cluster", "replicas-2"]
    assert router_peers(Configuration(1), "http://127.0.0.1:2379") == [PEERS["pd-router"]]


def test_an_i_suffix_names_independent_routers_without_etcd(bench_modules: None) -> None:
    from peers import PEERS, Topology
    from replica_throughput import parse_configurations, router_peers

    (alone,) = parse_configurations("2i")
    topology = Topology(prefills=(("http://127.0.0.1:1", 2),), decodes=("http://127.0.0.1:3",))
    assert (alone.name, alone.on_etcd) == ("2 routers, no etcd", False)
    plain = PEERS["pd-router"].argv(topology, "127.0.0.1", 8000)
    peers = router_peers(alone, "http://127.0.0.1:2379")
    assert [peer.argv(topology, "127.0.0.1", 8000) for peer in peers] == [plain, plain]
    assert len({peer.name for peer in peers}) == 2
