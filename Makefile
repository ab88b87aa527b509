# Two commands for a newcomer: `make run` and `make test` (see README.md); `make lab` for the notebooks.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test lab soak setup model bundle clean-venv

setup:
	@bash scripts/setup_venv.sh

## Start the causalboard server on the bundled model (HOST, PORT, MODEL override).
run: setup
	@exec $(VENV)/bin/causalboard serve

## Run the whole test suite on the real vLLM engine (CPU).
test: setup
	@bash scripts/run_tests.sh

## JupyterLab on notebooks/ with the project's kernel (LAB_HOST, LAB_PORT, LAB_OPEN override; scripts/lab.sh).
lab: setup
	@exec bash scripts/lab.sh

## Soak: a loopback server on the bundled model under mixed concurrent load for SOAK_SECONDS (default 600),
## every result checked against its solo run; writes soak.json (docs/reliability.md).
SOAK_SECONDS ?= 600
soak: setup
	$(PY) benchmarks/soak.py --duration $(SOAK_SECONDS) --out soak.json --log soak-server.log

## Retrain the bundled model from its seeded corpus (not needed to use the project).
model: setup
	$(PY) -m training.train && $(PY) -m training.evaluate && $(PY) -m training.causal_trace_hf

## Build the offline GPU-host vLLM bundle into .vbundle/ (see docs/development.md).
bundle:
	bash scripts/gpu/build_bundle.sh .vbundle

clean-venv:
	rm -rf $(VENV)
