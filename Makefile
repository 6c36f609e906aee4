# gpushared developer entry points. Everything runs from a virtualenv in .venv, made on first use.
SHELL := /bin/bash
PYTHON ?= $(shell command -v /usr/bin/python3 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: bench chaos chart inspect-plugin node-image venv test lint protos check-protos clean image-test k8s-testbins e2e e2e-cdi demo demo-down deb deb-test

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# Unit and integration tests (fakes over real sockets); the end-to-end suite has its own target.
test: venv
	$(BIN)/python -m pytest -m "not e2e and not image" $(PYTEST_ARGS)

lint: venv check-protos
	$(BIN)/ruff check gpushared tests scripts
	$(BIN)/ruff format --check gpushared tests scripts
	$(BIN)/mypy
	# What the .deb runs must work on the oldest interpreter it supports (Ubuntu 22.04's 3.10).
	$(BIN)/mypy --python-version 3.10 -m gpushared.cli.daemon -m gpushared.cli.inspect
	$(BIN)/lint-imports

protos: venv
	VENV=$(VENV) scripts/gen-protos

# The committed stubs must be exactly what the pinned generator makes from the committed .proto.
check-protos: protos
	git diff --exit-code -- gpushared/kubelet/ || \
	  { echo "generated stubs differ from api.proto: run 'make protos' and commit" >&2; exit 1; }

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .import_linter_cache

# The extender's container image (buildah; needs root), exported to dist/ for `ctr images import`. Built
# again only when what goes into it changed (`make -B image` forces it).
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' gpushared/__init__.py)
IMAGE_ARCHIVE := dist/gpushared-extender_$(VERSION).tar
image: $(IMAGE_ARCHIVE)

$(IMAGE_ARCHIVE): $(shell git ls-files gpushared extender pyproject.toml scripts/build-image 2>/dev/null) | venv
	PYTHON=$(BIN)/python scripts/build-image

# The node daemon's image, for the chart's DaemonSet (docs/install.md, "Managed node images").
NODE_IMAGE_ARCHIVE := dist/gpushared-node_$(VERSION).tar
node-image: $(NODE_IMAGE_ARCHIVE)

$(NODE_IMAGE_ARCHIVE): $(shell git ls-files gpushared packaging/node-image packaging/deb/requirements pyproject.toml scripts/build-image 2>/dev/null) | venv
	PYTHON=$(BIN)/python scripts/build-image node

# Build the image, then run it under containerd (root) and talk to it.
image-test: image
	command -v containerd >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q containerd; }
	$(BIN)/python -m pytest -m image tests/image $(PYTEST_ARGS)

# The Helm chart: helm v3.17 fetched by scripts/helm-bin (pinned), `helm lint --strict`, and every render
# checked for Kubernetes 1.20, 1.29 and 1.36 (tests/integration/test_chart.py; `make test` runs it too).
# Installing it on the real cluster, `helm test` and `helm uninstall` are in `make e2e`.
chart: venv
	scripts/helm-bin
	$(BIN)/python -m pytest tests/integration/test_chart.py $(PYTEST_ARGS)

# `kubectl inspect gpushare` as one file for an administrator's machine: dist/kubectl-inspect-gpushare.
inspect-plugin: venv
	PYTHON=$(BIN)/python scripts/build-inspect

# Real Kubernetes v1.20.2 binaries for the end-to-end suite (root; cached outside the repo; 6-8 min cold).
k8s-testbins:
	scripts/k8s-testbins

# The end-to-end suite on a real local cluster (root): apiserver, scheduler + our extender, kubelet,
# containerd, gpushared on a fake NVML library. Brings the cluster up and tears it down.
# The extender's image too: the control-plane cases run it as a static pod (tests/e2e/test_control_plane.py).
e2e: venv k8s-testbins image node-image
	$(BIN)/python -m pytest -m e2e tests/e2e $(PYTEST_ARGS)

# CDI for real: the same cluster with Debian 13's containerd (1.7, CDI on), a GPU named in a container's CDI
# annotation (deviceListStrategy cdi-annotations) and applied by containerd from a CDI spec (tests/e2e/test_cdi.py).
e2e-cdi: venv k8s-testbins
	GPUSHARED_K8S_CACHE=$$(scripts/k8s-testbins-cdi | tail -1) $(BIN)/python -m pytest -m e2e tests/e2e/test_cdi.py $(PYTEST_ARGS)

# The same cluster, left running with sample pods on it (root). `make demo-down` removes it.
demo: venv k8s-testbins
	$(BIN)/python -m tests.e2e.demo

demo-down: venv
	$(BIN)/python -m tests.e2e.cluster down

# The node daemon's Debian package (installs debhelper, dpkg-dev and python3-venv when missing, as root;
# network for the pinned wheels).
deb:
	scripts/build-deb

# Build and lint the .deb; install, run and purge it in debootstrapped Debian 12 and 13 chroots (root).
deb-test: venv
	WORLD_PYTHON=$(BIN)/python scripts/deb-test

# Placement quality on the Alibaba trace (needs the trace: GPUSHARED_TRACE_DIR, default ../shared/data/...):
# causal, as a running extender knows the workload, with an expected mix made from another trace (issue #41).
# Then how well linked multi-GPU tasks' GPUs are, on a model of each node's links (docs/benchmarks.md).
bench: venv
	$(BIN)/python scripts/bench_openb.py --policies binpack spread fgd
	$(BIN)/python scripts/bench_links.py

# The fault suite (docs/reliability.md): the extender under load while the API server stalls, loses
# answers and lands Bindings late, replicas are killed and callers are hostile. CHAOS_ARGS sizes it.
chaos: venv
	$(BIN)/python scripts/chaos.py $(CHAOS_ARGS)
