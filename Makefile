# Entry points for developers and CI. Versions of upstream components: hack/versions.env
# (override from the environment, e.g. `KUBE_VERSION=v1.36.3 make cluster-up`).

PYTHON ?= .venv/bin/python
HELM = $$(hack/build-kube.sh helm | sed -n 's/^HELM_BIN_DIR=//p')/helm
CHART = charts/dra-driver-gpu

.PHONY: help venv lock demo demo-real test lint unit e2e bench bench-go reliability gen gen-check kube-build mock-nvml cluster-up cluster-down cluster-status image deps e2e-versions e2e-versions-subset scale security

## help: list the targets
help:
	@grep -E '^## ' Makefile | sed 's/^## /  /'

## venv: create .venv with the package and its development tools, every dependency from the hashed lock
## requirements/dev.txt (only when pyproject.toml or the lock changed)
venv:
	@hack/setup-venv.sh

## lock: regenerate the hashed lock files requirements/runtime.txt (the image) and requirements/dev.txt
## (make venv, CI) from pyproject.toml, keeping the pins that still fit (hack/lock.sh --upgrade: newest)
lock: venv
	hack/lock.sh
	@hack/setup-venv.sh

## demo: a local control plane, the driver on a simulated DGX H100, the kubelet harness and sample claims
## (`make demo DEMO_NVML=mock`: the driver's NVML backend on the mock libnvidia-ml.so.1 instead)
demo: venv kube-build mock-nvml
	$(PYTHON) hack/demo.py

## test: everything CI checks: lint, generated-code checks, unit, component, integration and e2e tests
## (and the e2e subset against each older supported Kubernetes release)
test: lint gen-check unit e2e e2e-versions-subset

## lint: ruff, mypy --strict, helm lint --strict (default values and every ci/ values file)
lint: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	helm=$(HELM) && $$helm lint --strict $(CHART) && \
	  for values in $(CHART)/ci/*-values.yaml; do $$helm lint --strict $(CHART) --values $$values || exit 1; done

## unit: unit and component tests (no control plane needed; helm renders the chart). As root it installs
## the Debian packages first (make deps): the host-managed IMEX check runs chrooted on busybox-static
unit: venv kube-build mock-nvml
	@if [ "$$(id -u)" = 0 ]; then hack/install-deps.sh; fi
	$(PYTHON) -m pytest tests

## e2e: integration and end-to-end tests against the real control plane and the kubelet harness, and
## (e2e/real_node, root) the chart's image on a real kubelet + containerd + runc
e2e: venv kube-build mock-nvml image
	hack/build-kube.sh kubelet containerd >/dev/null
	$(PYTHON) -m pytest e2e

## e2e-versions: the whole e2e suite (but e2e/real_node) against each older supported Kubernetes release,
## KUBE_MATRIX_VERSIONS in hack/versions.env; each is built first when missing (~15 minutes per release)
e2e-versions: venv kube-build mock-nvml
	hack/e2e-versions.sh

## e2e-versions-subset: the e2e tests marked kube_versions against each of those releases (make test runs it)
e2e-versions-subset: venv kube-build mock-nvml
	hack/e2e-versions.sh --subset

## bench: prepare latency, throughput, start-up and RSS; writes _output/bench.json
bench: venv kube-build
	$(PYTHON) -m bench.prepare_bench

## bench-go: the same benchmark for our daemon and the Go reference driver (sigs.k8s.io/dra-example-driver,
## built into the cache by hack/build-go-reference.sh), alternating rounds (ROUNDS=3); writes _output/bench-go.json
bench-go: venv kube-build
	$(PYTHON) -m bench.compare_go $(if $(ROUNDS),--rounds $(ROUNDS))

## scale: 100 simulated nodes of 8 H100 (driver + kubelet harness each) on one control plane: publish,
## steady-state API requests, 800 pods, a rolling restart; writes _output/scale.json (SCALE_ARGS="--nodes 10")
scale: venv kube-build
	$(PYTHON) -m bench.scale $(SCALE_ARGS)

## reliability: the fault suite at full size (kill -9, API server outage, full disk, two instances,
## fuzzing), about 20 minutes; writes _output/reliability.json (`make test` runs a CI-sized subset)
reliability: venv kube-build mock-nvml
	$(PYTHON) -m e2e.reliability

## security: the attack suite: the chart's accounts, with real pod-bound tokens and by impersonation, try
## every write their roles allow on the real API server; writes _output/security.json (`make test` runs it too)
security: venv kube-build
	$(PYTHON) -m e2e.security

## gen: regenerate the committed generated code and docs (protobuf, config JSON schema, settings table)
gen: venv
	hack/gen-proto.sh
	$(PYTHON) hack/gen-config-schema.py
	$(PYTHON) hack/gen-config-docs.py

## gen-check: fail when generated code differs from what hack/ would generate, or the lock from pyproject.toml
gen-check: venv
	$(PYTHON) hack/check-lock.py
	hack/gen-proto.sh --check
	$(PYTHON) hack/gen-config-schema.py --check
	$(PYTHON) hack/gen-config-docs.py --check

## kube-build: build kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, the kubelet
## harness, etcd and helm into the version-keyed cache (only what is missing or stale)
kube-build:
	hack/build-kube.sh >/dev/null

## mock-nvml: build the mock libnvidia-ml.so.1 (NVML's C interface over NVIDIA's go-nvml GPU mocks) into
## the cache (only when missing or stale)
mock-nvml:
	hack/build-mock-nvml.sh >/dev/null

## deps: install the Debian packages the real node and `make image` need (only those missing; root)
deps:
	hack/install-deps.sh

## image: the driver's image, a pause and a workload image as OCI archives in _output/images (root;
## no Docker, no registry: umoci + mmdebstrap; the Debian part is cached in ~/.cache/dra-driver)
image: venv deps
	hack/build-image.sh

## cluster-up: start a local control plane in the background; admin kubeconfig in _output/kubeconfig
## (NODE=real: also a real node, kubelet + containerd + runc, as root; needs `make image` first)
cluster-up: venv kube-build
	$(PYTHON) -m e2e.cluster up $(if $(NODE),--node $(NODE))

## demo-real: a real node (kubelet + containerd + runc, root), the chart installed with the built
## image, and real containers printing their GPU view
demo-real: venv kube-build image
	hack/build-kube.sh kubelet containerd >/dev/null
	$(PYTHON) hack/demo_real.py

## cluster-down: stop every process cluster-up started
cluster-down:
	$(PYTHON) -m e2e.cluster down

## cluster-status: show whether the processes cluster-up started are still running
cluster-status:
	$(PYTHON) -m e2e.cluster status
