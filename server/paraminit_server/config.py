"""Server configuration from flags and PARAMINIT_* environment variables (flags win)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any

from paraminit_server import limits

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class ServerConfig:
    """Every knob of the server; the env variable is PARAMINIT_ + the upper-cased field name."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0 = pick a free port and print it
    backend: str = "auto"  # auto | cpu | cupy (numpy = cpu)
    device: int = 0
    threads: int = field(default_factory=limits.default_threads)  # CPU kernel threads; default: the container's CPU quota; 0 = all cores
    workers: int = 16  # gRPC worker threads
    max_plan_bytes: int = 16 * GiB
    max_param_bytes: int = 16 * GiB
    max_concurrent: int = 8
    chunk_bytes: int = 1 * MiB
    max_chunk_bytes: int = 4 * MiB - 64 * 1024  # a chunk plus its framing stays under gRPC's default 4 MiB receive limit
    slab_bytes: int = 16 * MiB  # generation granularity of STREAM deliveries
    lease_ttl: float = 300.0
    max_lease_ttl: float = 3600.0
    max_leased_bytes: int = 64 * GiB
    max_leases_per_client: int = 64
    shm_pool_bytes: int = 0  # keep released SHM segments (renamed) for the same identity's next export; 0 = off
    metrics_port: int = 0  # Prometheus HTTP port; 0 = off, -1 = any free port
    drain_seconds: float = 25.0
    # host bytes requests may hold (slabs, payloads, SHM exports); default: half the container's memory limit,
    # 0 = half of what is free at start
    memory_budget: int = field(default_factory=limits.default_memory_budget)
    device_memory_budget: int = 0  # GPU bytes requests may hold (device slabs, CUDA IPC exports); 0 = half of free
    admission_wait: float = 5.0  # longest wait for memory when the client's deadline allows it
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


def _parse(name: str, raw: str, kind: type) -> Any:
    try:
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return kind(raw)
    except ValueError:
        raise ValueError(f"PARAMINIT_{name.upper()}={raw!r} is not a valid {kind.__name__}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one --flag per config field; unset flags fall back to the environment, then defaults."""
    defaults = ServerConfig()
    for f in fields(ServerConfig):
        default = getattr(defaults, f.name)
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(default), default=None,
                            help=f"(env PARAMINIT_{f.name.upper()}, default {default!r})")


def from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig.from_env(**{f.name: getattr(args, f.name, None) for f in fields(ServerConfig)})
