# make demo / make test work on a fresh clone: both create .venv and install the project first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/paraminit/v1/*.proto)

.PHONY: venv demo test test-fast lint proto proto-check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# PyTorch tests (tests/test_torch.py) run against the CPU build; they skip cleanly without torch.
	$(PY) -m pip install -q 'torch==2.13.0' || echo "torch 2.13.0 not installable here: PyTorch tests will skip"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/paraminit materialize examples/gpt2_small.json -o demo.safetensors --summary

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check proto server client tests bench
	$(VENV)/bin/mypy server/paraminit_server client/paraminit_client

# Regenerates the committed contract code; tests/test_proto_fresh.py fails when it is stale.
proto: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m grpc_tools.protoc -I proto --python_out=proto --grpc_python_out=proto \
		--mypy_out=proto --mypy_grpc_out=proto $(PROTOS)

bench: $(STAMP)
	$(PY) bench/cpu_sampler.py
	$(PY) bench/transport.py
	$(PY) bench/export.py
	$(PY) bench/torch_model.py

clean:
	rm -rf $(VENV) build *.egg-info demo.safetensors
