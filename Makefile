# make demo / make test work on a fresh clone: both create .venv and install the project first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/paraminit/v1/*.proto)

.PHONY: venv vision demo test test-fast lint contract proto kernel-tables bench gpu-wheels image-check clean \
	extra-torch extra-hf extra-plot extra-jax extra-torchtitan extra-recipes extra-vision

# PyTorch's CPU build, pinned: from PyTorch's CPU wheel index where it is reachable, else the same release from the
# configured index (PyPI's Linux wheel of this name is the CUDA build, several GB, where no CPU file is provided).
TORCH_CPU := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# pip install -e, its output (setuptools warns about every editable install of this multi-directory layout) shown
# only when it fails
install_editable = $(PY) -m pip install -q -e $(1) >$(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
install_torch_cpu = $(PY) -m pip install -q --retries 0 --timeout 10 '$(TORCH_CPU)' --index-url $(TORCH_CPU_INDEX) 2>/dev/null || \
	$(PY) -m pip install -q '$(TORCH_CPU)'

# The demo needs the package alone (numpy, numba, grpc, ...): a small venv in well under a minute.
$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(call install_editable,.)
	touch $(BASE)

# Tests and lint add the test and lint stack, PyTorch, torchtitan and, as root with apt, Debian's promtool.
$(STAMP): $(BASE)
	$(PY) -m pip install -q -e '.[dev]'
	# The CPU kernels compile into numba's cache (once per machine, 80-100 core-seconds) on the core the installs
	# below leave idle, so the suite starts without compiling. Its own prebuild (tests/conftest.py) still checks the
	# cache and compiles whatever this one missed (a kernel that failed here, or numba changed by a later install).
	{ $(PY) -m paraminit_server.prebuild --cpu --processes 1; echo "prebuild exit status $$?"; } >$(VENV)/prebuild.log 2>&1 & \
		echo $$! >$(VENV)/prebuild.pid
	# PyTorch tests (tests/test_torch.py) run against the CPU build; they skip cleanly without torch.
	$(install_torch_cpu) || echo "$(TORCH_CPU) not installable here: PyTorch tests will skip"
	# promtool (Debian's prometheus package) for tests/test_prometheus_rules.py, where this runs as root with apt.
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		echo "installing Debian's prometheus system-wide (promtool, for the alert rule tests)"; } || true
	command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; }; }; } || \
		echo "promtool not installable here: the alert rule tests will skip"
	# torchtitan (tests/test_torchtitan.py) after torch, so its requirements find the CPU build installed.
	$(PY) -m pip install -q -e '.[torchtitan]' || echo "torchtitan not installable here: torchtitan tests will skip"
	# megatron-core and OLMo-core (tests/test_recipes.py builds their own models), also after torch.
	$(PY) -m pip install -q -e '.[recipes]' || echo "megatron-core or OLMo-core not installable here: their recipe tests will skip"
	# torchvision and timm (the own-initialization zoo, tests/test_own_init.py), after torch: see the vision target.
	$(MAKE) --no-print-directory vision || echo "torchvision or timm not installable here: the zoo's models of theirs will skip"
	# mup (the muP recipe's test checks against it) without its requirements: they name torchvision, which would
	# replace the CPU torch above, and seaborn and pandas, which only its plotting module imports.
	$(PY) -m pip install -q --no-deps 'mup==1.0.0' || echo "mup not installable here: the muP recipe test will skip"
	@pid=$$(cat $(VENV)/prebuild.pid); while kill -0 $$pid 2>/dev/null; do sleep 1; done; rm -f $(VENV)/prebuild.pid
	@tail -n 2 $(VENV)/prebuild.log | grep -q "prebuild exit status 0" && tail -n 2 $(VENV)/prebuild.log | head -n 1 || \
		echo "compiling the CPU kernels ahead failed ($(VENV)/prebuild.log); the suite's start compiles them"
	touch $(STAMP)

venv: $(STAMP)

# torchvision and timm beside the pinned CPU PyTorch: the torchvision release made for it (its requirement is that torch,
# which the CPU build satisfies) and timm. PyPI's torchvision is built against PyTorch's CUDA build, so its compiled
# operators do not load beside the CPU build; deploy/torchvision-cpu's import hook (a .pth in the venv) declares their
# two schemas when, and only when, that library did not load, so `import torchvision` completes (model code needs none
# of its operators). With PyTorch's CPU wheel index reachable, its torchvision needs no hook.
TORCHVISION := torchvision==0.28.0
vision: $(BASE)
	$(PY) -m pip install -q -e '.[vision]' '$(TORCHVISION)'
	$(PY) -c "import shutil, sysconfig; d = sysconfig.get_paths()['purelib']; \
		shutil.copy('deploy/torchvision-cpu/paraminit_torchvision_ops.py', d); \
		open(d + '/paraminit-torchvision-ops.pth', 'w').write('import paraminit_torchvision_ops\n')"
	$(PY) -c "import torchvision, timm; print('torchvision', torchvision.__version__, 'and timm', timm.__version__, 'import')"

# One way to add each extra to the demo's environment (the README's): the package stays installed in editable mode, so
# edits keep applying and the CPU kernels compiled for it stay valid, and PyTorch is its CPU build, installed first so
# that no extra's requirement takes the CUDA build.
extra-torch extra-hf extra-torchtitan extra-recipes: $(BASE)
	$(install_torch_cpu)
	$(call install_editable,'.[$(@:extra-%=%)]' '$(TORCH_CPU)')
extra-plot extra-jax: $(BASE)
	$(call install_editable,'.[$(@:extra-%=%)]')
extra-vision: vision

# Every CPU kernel (each kind of value and dtype) is compiled into numba's cache first, about 30 s on two cores and a
# second once cached, so that no later command compiles in front of the user; then the demo loads them.
demo: $(BASE)
	$(PY) -m paraminit_server.prebuild --cpu
	$(VENV)/bin/paraminit materialize examples/gpt2_small.json -o demo.safetensors
	@echo
	@echo "paraminit is installed in $(VENV)/bin, which is not on your PATH. Run it as"
	@echo "  $(VENV)/bin/paraminit --help"
	@echo "or activate the environment first:"
	@echo "  . $(VENV)/bin/activate && paraminit inspect demo.safetensors"

# Two workers (pytest-xdist): the suite's servers and subprocesses keep both cores of a small machine busy.
# Bytecode caches are written even where the environment says not to (PYTHONDONTWRITEBYTECODE): the suite starts
# hundreds of Python processes (servers, command lines, ranks), each of which would compile the project's modules
# again, and each worker would rewrite every test module's asserts again.
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2

# The inner loop: everything but the tests marked slow (the README's blocks, multi-process ranks, kernel builds,
# cold compiles). `make test` and .ci/run still run every test.
test-fast: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check proto server client tests bench
	$(VENV)/bin/ruff format --check proto server client tests bench
	$(VENV)/bin/mypy server/paraminit_server client/paraminit_client
	$(PY) tests/contract_compat.py

# buf (npm @bufbuild/buf, pinned) on the contract: `buf lint` with proto/buf.yaml's exceptions, and `buf breaking`
# (wire and JSON) against CONTRACT_BASE, a git ref (default: the previous commit). Needs node's npx and the npm
# registry, so it is a target of its own; `make lint` checks the same wire and JSON rules offline against the
# released descriptors (tests/contract_compat.py, proto/released/).
BUF := npx --yes @bufbuild/buf@1.75.0
CONTRACT_BASE ?= HEAD~1
contract:
	$(BUF) lint proto
	$(BUF) breaking proto --against '.git#ref=$(CONTRACT_BASE),subdir=proto'

# Regenerates the committed contract code; tests/test_proto_fresh.py fails when it is stale. contract.binpb holds the
# descriptors with their comments, which server reflection serves (the generated code carries none).
proto: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m grpc_tools.protoc -I proto --python_out=proto --grpc_python_out=proto \
		--mypy_out=proto --mypy_grpc_out=proto --include_source_info \
		--descriptor_set_out=proto/paraminit/v1/contract.binpb $(PROTOS)

# Rewrites the table block of the CUDA header from the CPU kernels' tables (cpu_kernels/cr_tables.py);
# tests/test_kernel_tables.py fails when the committed block is stale.
kernel-tables: $(STAMP)
	$(PY) -m paraminit_server.backends.kernel_tables

bench: $(STAMP)
	$(PY) bench/cpu_sampler.py
	$(PY) bench/transport.py
	$(PY) bench/export.py
	$(PY) bench/torch_model.py

# Wheels for the GPU check machine (Python 3.12, x86_64), for packages its image lacks; bench/gpu_check.sh installs
# them offline from .whl/. Versions are the GPU lock's (deploy/requirements-gpu.lock), so no dev venv is built to
# read them; mpmath (the tests' reference arithmetic) is pinned here. pytest is not shipped: the image's own runs,
# with its plugins' autoload off, so a wheel never shadows it.
GPU_WHEELS := protobuf grpcio grpcio-status grpcio-health-checking grpcio-reflection googleapis-common-protos crc32c \
	typing-extensions ml-dtypes pyyaml tqdm prometheus-client
GPU_TEST_WHEELS := mpmath==1.3.0
gpu-wheels: $(BASE)
	mkdir -p .whl
	for pkg in $(GPU_WHEELS); do \
		pin=$$(grep -i -m1 "^$$pkg==" deploy/requirements-gpu.lock | cut -d' ' -f1); \
		[ -n "$$pin" ] || { echo "$$pkg is not in deploy/requirements-gpu.lock"; exit 1; }; \
		echo "$$pin"; \
	done > .whl/pins.txt || exit 1
	echo $(GPU_TEST_WHEELS) | tr ' ' '\n' >> .whl/pins.txt
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl -r .whl/pins.txt

# Builds the CPU image without a registry and runs it hardened (root, Docker, mmdebstrap); not part of `make test`.
# The CPU image (what docker-compose.yml runs); GPU=1 also builds the GPU image and compiles its kernels without a GPU.
image-check:
	$(if $(GPU),TARGETS="cpu gpu" )deploy/image-check.sh

clean:
	rm -rf $(VENV) build *.egg-info demo.safetensors
