# Two commands do all the set-up: `make run` (the main job) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv run test gpu-test
venv:
	@tools/venv.sh $(VENV)

run: venv
	$(VENV)/bin/layerflow bench

test: venv
	@tools/ensure_redis.sh
	$(PY) -m pytest -m "not gpu" -q

gpu-test: venv
	$(PY) -m pytest -m gpu -q
