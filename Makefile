# Entry points for developers and CI. Versions of upstream components: hack/versions.env
# (override from the environment, e.g. `KUBE_VERSION=v1.36.3 make cluster-up`).

PYTHON ?= .venv/bin/python

.PHONY: kube-build cluster-up cluster-down cluster-status

## kube-build: build kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, the kubelet
## harness, etcd and helm into the version-keyed cache (only what is missing or stale)
kube-build:
	hack/build-kube.sh

## cluster-up: start a local control plane in the background; admin kubeconfig in _output/kubeconfig
cluster-up:
	$(PYTHON) -m e2e.cluster up

## cluster-down: stop every process cluster-up started
cluster-down:
	$(PYTHON) -m e2e.cluster down

## cluster-status: show whether the processes cluster-up started are still running
cluster-status:
	$(PYTHON) -m e2e.cluster status
