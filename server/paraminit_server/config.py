"""Server configuration from flags and PARAMINIT_* environment variables (flags win)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any

from paraminit import exitcodes, sizes
from paraminit_server import __version__, host_limits

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class ServerConfig:
    """Every knob of the server; the env variable is PARAMINIT_ + the upper-cased field name."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0 = pick a free port and print it
    backend: str = "auto"  # auto | cpu | cupy (numpy = cpu)
    device: int = 0
    threads: int = field(default_factory=host_limits.default_threads)  # CPU kernel threads; default: the cgroup's CPU quota; 0 = all cores
    workers: int = 48  # threads that run calls whose request has arrived: running + queued + control calls (Release, ...)
    max_rpcs: int = 1024  # calls in flight (receiving their request, queued or running); health is never counted
    max_plan_bytes: int = 16 * GiB
    max_param_bytes: int = 16 * GiB
    max_concurrent: int = 8
    chunk_bytes: int = 1 * MiB
    max_chunk_bytes: int = 4 * MiB - 64 * 1024  # a chunk plus its framing stays under gRPC's default 4 MiB receive limit
    slab_bytes: int = 2 * MiB  # generation granularity of STREAM deliveries: a stream holds 4 slabs (engine.iter_slabs)
    lease_ttl: float = 300.0
    max_lease_ttl: float = 3600.0
    max_leased_bytes: int = 64 * GiB
    max_leases_per_client: int = 64
    max_leased_bytes_per_client: int = 0  # 0 = 3/4 of the smaller of --max-leased-bytes and the memory budget
    max_concurrent_per_client: int = 0  # 0 = --max-concurrent less a quarter (at least 1)
    max_queued_per_client: int = 0  # 0 = half of --max-queued (at least 1)
    shm_pool_bytes: int = 0  # keep released SHM segments (renamed) for the same identity's next export; 0 = off
    metrics_port: int = 0  # Prometheus HTTP port; 0 = off, -1 = any free port
    drain_seconds: float = 25.0
    # host bytes requests may hold (slabs, payloads, SHM exports); default: half the container's memory limit,
    # 0 = half of what is available (MemAvailable) at start
    memory_budget: int = field(default_factory=host_limits.default_memory_budget)
    device_memory_budget: int = 0  # GPU bytes requests may hold (device slabs, CUDA IPC exports); 0 = half of free
    admission_wait: float = 5.0  # longest wait for memory when the client's deadline allows it
    max_queued: int = 32  # calls that may wait for a concurrency slot; beyond it RESOURCE_EXHAUSTED
    max_queue_wait: float = 60.0  # longest wait in line for a slot (and at most half the call's deadline)
    queue_wait_no_deadline: float = 0.0  # wait in line for calls without a deadline; 0 = refuse when busy
    max_stall: float = 20.0  # a stream whose client stops reading, or an upload whose client stops sending, ends
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""  # set: clients must present a certificate signed by it (mutual TLS)
    auth_tokens_file: str = ""  # lines of `identity:token`
    auth_tokens: str = ""  # comma-separated `identity:token` (prefer the file)
    max_payload_bytes: int = 8 * GiB  # uploaded flat payloads, held as binary64
    payload_ttl: float = 3600.0
    safetensors_dirs: str = ""  # colon-separated directories whose safetensors files plans may name
    log_level: str = "INFO"
    log_format: str = "text"  # text | json

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if (value.upper() if name == "log_level" else value) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is not one of {', '.join(allowed)}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> ServerConfig:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"PARAMINIT_{f.name.upper()}")
            if raw is not None:
                values[f.name] = _parse(f.name, raw, type(getattr(cls(), f.name)))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


# Byte-size fields: flags and variables take human sizes (2GiB, 512M, ...; paraminit.sizes).
# enumerated flags: argparse and the environment accept only these
CHOICES: dict[str, tuple[str, ...]] = {
    "backend": ("auto", "cpu", "numpy", "cupy"),
    "log_format": ("text", "json"),
    "log_level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
}
SIZE_FIELDS = frozenset(
    {
        "max_plan_bytes",
        "max_param_bytes",
        "chunk_bytes",
        "max_chunk_bytes",
        "slab_bytes",
        "max_leased_bytes",
        "shm_pool_bytes",
        "memory_budget",
        "device_memory_budget",
        "max_payload_bytes",
        "max_leased_bytes_per_client",
    }
)

# What each knob means, for --help (README's configuration text says the same).
HELP: dict[str, str] = {
    "host": "address to listen on (0.0.0.0: every interface)",
    "port": "gRPC port; 0 = pick a free port and print it",
    "backend": "auto (CuPy when it imports and a GPU is present, else cpu), cpu (alias numpy) or cupy",
    "device": "CUDA device ordinal for the cupy backend",
    "threads": "CPU kernel threads; 0 = every core; the default is the container's CPU quota (0 without one)",
    "workers": "threads that run calls once their request has arrived, queued ones included (keep it above "
    "--max-concurrent + --max-queued, with room for lease calls); health and reflection need none",
    "max_rpcs": "calls in flight at once, whether still receiving their request, queued or running (one caller "
    "at most three quarters of them); beyond it RESOURCE_EXHAUSTED on the headers; health is never counted; 0 = no bound",
    "max_plan_bytes": "largest plan (all its parameters' bytes) a call may materialize",
    "max_param_bytes": "largest single parameter",
    "max_concurrent": "materializations running at once; beyond it calls wait in line (--max-queued)",
    "chunk_bytes": "STREAM data chunk size when the client asks for none",
    "max_chunk_bytes": "largest chunk a client may ask for (a chunk and its framing stay under gRPC's 4 MiB message limit)",
    "slab_bytes": "generation granularity of STREAM deliveries: host memory one stream holds",
    "lease_ttl": "seconds an SHM / CUDA IPC lease lives when the client asks for no time to live",
    "max_lease_ttl": "longest lease time to live (seconds) a client may ask for",
    "max_leased_bytes": "bytes all live leases may hold together",
    "max_leases_per_client": "live leases one identity may hold",
    "max_leased_bytes_per_client": "bytes one identity's live leases may hold; 0 = three quarters of the smaller of "
    "--max-leased-bytes and --memory-budget, so one identity's leases always leave "
    "room for the others' streams",
    "max_concurrent_per_client": "materializations one identity may run at once; 0 = --max-concurrent less a "
    "quarter (at least 1), so one identity never holds every slot",
    "max_queued_per_client": "calls one identity may have waiting in line; 0 = half of --max-queued (at least 1)",
    "shm_pool_bytes": "keep released SHM segments for the same identity's next export, up to this size; 0 = off",
    "metrics_port": "Prometheus HTTP port; 0 = off, -1 = any free port",
    "drain_seconds": "on SIGTERM, how long running streams may take to finish before the server exits",
    "memory_budget": "host bytes requests may hold (slabs, payloads, SHM exports); 0 = half of the memory available at "
    "start; the default is half the container's memory limit (0 without one)",
    "device_memory_budget": "GPU bytes requests may hold (device slabs, CUDA IPC exports); 0 = half of the device memory free at start",
    "admission_wait": "longest wait (seconds) for memory when the client's deadline allows it; calls without a "
    "deadline are refused at once",
    "max_queued": "calls that may wait for a concurrency slot (round-robin across identities, arrival order within "
    "one); beyond it RESOURCE_EXHAUSTED; keep --workers above --max-concurrent plus this",
    "max_queue_wait": "longest wait (seconds) in line for a concurrency slot; a call waits at most half its deadline",
    "queue_wait_no_deadline": "wait (seconds) in line for calls without a deadline; 0 = refuse them at once when every slot is taken",
    "max_stall": "seconds a stream's client may stop reading, or an upload's client stop sending, before the call "
    "is cancelled and its slot and memory go back; 0 = never",
    "tls_cert": "server certificate (PEM) for TLS; needs --tls-key",
    "tls_key": "server private key (PEM) for TLS; needs --tls-cert",
    "tls_ca": "CA certificate (PEM): clients must present a certificate it signed (mutual TLS)",
    "auth_tokens_file": "file of identity:token lines; set: every call needs 'authorization: Bearer TOKEN'",
    "auth_tokens": "comma-separated identity:token pairs (prefer the file: variables show up in process listings)",
    "max_payload_bytes": "uploaded flat payloads in total, held as binary64; one identity holds at most three quarters of it",
    "payload_ttl": "seconds an uploaded payload lives",
    "safetensors_dirs": "colon-separated directories whose safetensors files plans may name; empty = none",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "text, or json (one JSON object per line)",
}


def _parse(name: str, raw: str, kind: type) -> Any:
    try:
        if name in SIZE_FIELDS:
            return sizes.parse_size(raw)
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return kind(raw)
    except ValueError as exc:
        why = f": {exc}" if name in SIZE_FIELDS else ""
        raise ValueError(
            f"PARAMINIT_{name.upper()}={raw!r} is not a valid {'size' if name in SIZE_FIELDS else kind.__name__}{why}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser, version: bool = True) -> None:
    """Add one --flag per config field; unset flags fall back to the environment, then defaults.

    Args:
        parser: the parser to extend; its epilog becomes the fallback rule, the size units and the exit codes.
        version: add --version too (False where the parser has its own).
    """
    defaults = ServerConfig()
    if version:
        parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.epilog = f"Each flag falls back to its PARAMINIT_* variable, then to its default; {sizes.UNITS_HELP}.\n\n{exitcodes.SERVER_HELP}"
    for f in fields(ServerConfig):
        default = getattr(defaults, f.name)
        size = f.name in SIZE_FIELDS
        shown = sizes.exact_size(default) if size else repr(default)
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            type=sizes.size_arg if size else type(default),
            default=None,
            metavar="SIZE" if size else None,
            choices=CHOICES[f.name] if f.name in ("backend", "log_format") else None,
            help=f"{HELP.get(f.name, '')} (env PARAMINIT_{f.name.upper()}; default {shown})",
        )


def from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig.from_env(**{f.name: getattr(args, f.name, None) for f in fields(ServerConfig)})
