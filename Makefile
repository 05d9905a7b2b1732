# The two commands in the README: `make serve` and `make test`. Each installs
# what it needs first (scripts/install.sh is a no-op once done).
PY := .venv/bin/python

.PHONY: install install-system serve test test-unit test-faults test-containers bench demo-model train-demo accuracy

install:
	@scripts/install.sh

install-system:
	@scripts/install-system.sh

serve: install
	$(PY) -m prism serve

test: install install-system
	$(PY) -m pytest

test-unit: install
	$(PY) -m pytest tests/unit

# Services killed, stopped and restarted on stacks of their own (tests/faults/):
# mostly waiting for restarts, so kept out of `make test`'s time; CI runs it next.
test-faults: install install-system
	$(PY) -m pytest tests/faults

# The compose stack built and run for real (tests/containers/): as root, with
# Docker, debootstrap and tcpdump from Debian's packages, installed when missing.
test-containers: install
	@scripts/install-system.sh containers
	$(PY) -m pytest tests/containers

bench: install
	$(PY) -m bench.ttft

demo-model: install
	$(PY) -m prism demo-model

# Re-train the demo model from scratch (docs/demo-model.md).
train-demo: install
	$(PY) -m prism.train_demo --out models/prism-shapes

# Its held-out accuracy through gateway -> encoder -> engine.
accuracy: install
	$(PY) -m bench.accuracy $(ARGS)

# kustomize loads no file from outside a kustomization's tree, so the Kubernetes
# base holds a copy of the Grafana dashboard; configs/grafana/ is its one source
# (tests/unit/test_kubernetes.py fails while the two differ). Phony: a copy
# edited by hand is newer than its source and would otherwise be kept.
.PHONY: deploy/kubernetes/base/prism-dashboard.json
deploy/kubernetes/base/prism-dashboard.json: configs/grafana/prism-dashboard.json
	cp $< $@
