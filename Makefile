# One venv for everything. Its stamps re-install when pyproject.toml changes: STAMP is the
# package with the test tools (what the demo, lint and the benchmarks need), TORCH_STAMP adds the
# torch extra (torch, tokenizers, mooncake: about 900 MB) and the otel extra (OpenTelemetry's SDK
# and OTLP exporter: the tracing tests) for the tests and the torch demo.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.installed-torch

.PHONY: install browser kube-apiserver sglang-venv demo demo-sglang demo-torch test test-fast lint bench bench-worker bench-overhead bench-convert bench-rebalance screenshot clean

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

$(TORCH_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install --quiet -e '.[test,torch,otel]'
	@touch $(TORCH_STAMP)

install: $(TORCH_STAMP)

demo: $(STAMP)
	$(VENV)/bin/pd-router demo

# The torch engine behind the router: outputs checked against a colocated model, one conversion.
demo-torch: $(TORCH_STAMP)
	$(VENV)/bin/python bench/demo_torch.py

# Real SGLang 0.5.23 on the CPU behind the router: a colocated reference and a 2P2D, token checks,
# a conversion each way under traffic (docs/real-sglang.md). The first run builds SGLang's venv
# (about 11 GB, 3-5 minutes); the servers take 1.5-3 minutes to start on 2 cores.
demo-sglang: $(STAMP) sglang-venv
	$(VENV)/bin/python bench/demo_sglang.py

# Tools some tests drive for real: headless Chromium (the status page), Prometheus' promtool
# (alert rules) and etcd (the replicas' coordination store), and the shared libraries mooncake's
# TransferEngine links against (the KV transfer tests import it; found with ldconfig, since they
# are libraries, not commands). Debian's packages, installed when absent and possible; otherwise
# those tests skip.
TEST_TOOLS := chromium:chromium promtool:prometheus etcd:etcd-server
TEST_LIBS := libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1
browser:
	@missing=""; for t in $(TEST_TOOLS); do command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t#*:}"; done; \
	for l in $(TEST_LIBS); do ldconfig -p | grep -qF "$${l%%:*} " || missing="$$missing $${l#*:}"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null \
			|| echo "could not install$$missing: the tests that need them will be skipped"; \
		else echo "not installed:$$missing: the tests that need them will be skipped"; fi; \
	fi

# A kube-apiserver for the Kubernetes discovery tests, built once from Debian's source package
# (about 6 minutes and 1.3 GB of memory the first time, then cached in ~/.cache/pd-router);
# when it cannot be built those tests skip, saying why.
kube-apiserver: browser
	@tests/k8s/build_kube_apiserver.sh >/dev/null || echo "no kube-apiserver: the Kubernetes tests will be skipped"

# Real SGLang 0.5.23 on the CPU for the real_sglang tests and make demo-sglang: its own venv
# (SGLang pins a CUDA torch: about 11 GB and 3-5 minutes the first time, then cached in
# ~/.cache/pd-router) and a stand-in libcuda; tests/sglang_cpu/build_venv.sh. Without it those tests
# skip, saying why.
sglang-venv: browser
	@tests/sglang_cpu/build_venv.sh >/dev/null || echo "no SGLang venv: the real-SGLang tests will be skipped"

test: $(TORCH_STAMP) browser kube-apiserver sglang-venv
	$(VENV)/bin/python -m pytest -q --durations=25

# The unit lane (tests/unit/): decisions tested with no process and no socket, in seconds;
# make test runs them too.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m mypy

# Benchmarks (minutes, not part of make test); figures and commands in docs/PERFORMANCE.md.
bench: bench-worker bench-overhead bench-convert

bench-worker: $(STAMP)
	$(VENV)/bin/python bench/worker_throughput.py

bench-overhead: $(STAMP)
	$(VENV)/bin/python bench/overhead.py

bench-convert: $(STAMP)
	$(VENV)/bin/python bench/convert_under_load.py

# KV bytes per second over mooncake's TransferEngine (TCP) vs the plain-TCP transport (~20 s).
.PHONY: bench-kv-transfer
bench-kv-transfer: $(TORCH_STAMP) browser
	$(VENV)/bin/python bench/kv_transfer.py

# The autopilot against static P:D splits on a phase-shifting trace (~13 min; plots with matplotlib).
bench-rebalance: $(STAMP)
	$(VENV)/bin/python -c "import matplotlib" 2>/dev/null || $(VENV)/bin/python -m pip install --quiet -e '.[bench]'
	$(VENV)/bin/python bench/rebalance.py

screenshot: $(STAMP) browser
	$(VENV)/bin/python bench/screenshot.py

clean:
	rm -rf $(VENV) build *.egg-info
