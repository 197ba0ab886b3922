"""JAX arrays from a plan, shard by shard: the bytes of a PyTorch twin's parameters on any device mesh.

Every paraminit value depends only on (initializer, global index), so each
device's shard under any ``jax.sharding.Sharding`` can be asked for as a plan
region and filled with exactly the bytes of the single-device tensor. Nothing
else is generated: a process requests only the boxes of its addressable
devices (replicas of one box are generated once and copied to each device),
never a full tensor it does not own.

``layouts`` deliver a parameter in another axis order than the plan's: Flax
``Dense``/``nnx.Linear`` kernels are ``[in, out]`` where PyTorch ``Linear``
weights are ``[out, in]``, so a plan made from the PyTorch model serves the
Flax model with ``layouts={"fc.weight": (1, 0)}``. The array is then the
permuted full tensor (``full.transpose(perm)``), and a shard's box in the
plan's layout is its box with the axes permuted back.

JAX is imported when a function here is called, not when this module is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paraminit.v1 import plan_pb2
from paraminit_client.client import Client, or_in_process
from paraminit_client.errors import InvalidArgument, require

__all__ = ["materialize", "plan_boxes"]

Box = tuple[tuple[int, int], ...]


def _perm_of(name: str, rank: int, layouts: Mapping[str, Sequence[int]] | None) -> tuple[int, ...]:
    perm = tuple(int(a) for a in (layouts or {}).get(name, range(rank)))
    if sorted(perm) != list(range(rank)):
        raise InvalidArgument(f"layout of {name!r} must be a permutation of its {rank} axes, got {list(perm)}")
    return perm


def _box_of(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """A shard index (slices, as Sharding.addressable_devices_indices_map gives) as (start, stop) per dim."""
    box = []
    for s, dim in zip(index, shape, strict=True):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise InvalidArgument(f"shard index {index} has a step: not a box")
        box.append((start, max(start, stop)))
    return tuple(box)


def plan_boxes(shape: Sequence[int], sharding: Any, perm: Sequence[int]) -> dict[Any, tuple[Box, Box]]:
    """device -> (box in the array's layout, the same box in the plan's layout) for every addressable device.

    Args:
        shape: the plan's full shape of the parameter.
        sharding: a jax.sharding.Sharding of the permuted array.
        perm: the axis permutation (array axis i is plan axis perm[i]).
    Returns:
        One entry per addressable device of the sharding.
    """
    array_shape = tuple(int(shape[a]) for a in perm)
    out = {}
    for device, index in sharding.addressable_devices_indices_map(array_shape).items():
        box = _box_of(index, array_shape)
        out[device] = (box, _unpermute(box, perm))
    return out


def materialize(
    plan: plan_pb2.Plan, client: Client | None = None, *, shardings: Any = None, layouts: Mapping[str, Sequence[int]] | None = None
) -> dict[str, Any]:
    """Every parameter of `plan` as a ``jax.Array``, each addressable shard filled from its own box only.

    Args:
        plan: full-tensor parameters (no regions: the shardings choose them).
        client: the paraminit client to ask; None means an in-process ``Client()``.
        shardings: a ``jax.sharding.Sharding`` for every parameter, or a mapping from names to shardings;
            a parameter without one is placed whole on the first local device.
        layouts: name -> axis permutation; that parameter arrives as ``full.transpose(perm)``.
    Returns:
        name -> jax.Array of the plan's dtype (bfloat16, float16 and the 8-bit floats as JAX's own dtypes).
    Raises:
        ValueError: a region in the plan, a sharding or layout for a name the plan lacks, a layout that is
            not a permutation, a shard that is not a box, or float64 without ``jax_enable_x64``.
        ParaminitError: the server refused the plan (every violation named) or failed.
        MissingPackage: JAX is not installed (the message says how to install it).

    Example:
        from paraminit_client import param, plan_of
        from paraminit_client.jax import materialize

        plan = plan_of([param("w", [4, 8], {"normal": {"std": 0.02, "seed": 1}}, "bfloat16")])
        arrays = materialize(plan)  # an in-process Client(); pass client= for a server, shardings= to shard
        assert arrays["w"].shape == (4, 8) and str(arrays["w"].dtype) == "bfloat16"
    """
    jax = require("jax", "paraminit_client.jax")

    names = [p.name for p in plan.params]
    known = set(names)
    if len(known) != len(names):
        raise InvalidArgument("the plan names a parameter twice")
    by_name: Mapping[str, Any] | None = shardings if isinstance(shardings, Mapping) else None
    for what, given in (("sharding", by_name), ("layout", layouts)):
        unknown = sorted(set(given or {}) - known)
        if unknown:
            raise InvalidArgument(f"{what}s given for names the plan does not have: {', '.join(map(repr, unknown))}")
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    wide = [p.name for p in plan.params if p.dtype == plan_pb2.DTYPE_FLOAT64]
    if wide and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        raise InvalidArgument(
            f"float64 parameters ({', '.join(map(repr, wide[:5]))}) need jax_enable_x64; JAX would silently hold them as float32"
        )

    request = plan_pb2.Plan()
    wanted: list[tuple[plan_pb2.Param, Any, tuple[int, ...], dict[Any, tuple[str | None, Box]]]] = []
    for p in plan.params:
        if p.region:
            raise InvalidArgument(f"{p.name!r} has a region; give the full tensor and let the sharding choose shards")
        shape = [int(d) for d in p.shape]
        perm = _perm_of(p.name, len(shape), layouts)
        sharding = by_name.get(p.name, default) if by_name is not None else (shardings or default)
        shards: dict[Any, tuple[str | None, Box]] = {}
        requested: dict[Box, str] = {}
        for device, (box, plan_box) in plan_boxes(shape, sharding, perm).items():
            if any(b <= a for a, b in plan_box):
                shards[device] = (None, box)  # an empty shard: nothing to generate
                continue
            if plan_box not in requested:  # replicas of a box are generated once
                q = request.params.add()
                q.CopyFrom(p)
                q.name = f"{p.name}@{len(requested)}"
                if plan_box != tuple((0, d) for d in shape):
                    for a, b in plan_box:
                        q.region.add(start=a, stop=b)
                requested[plan_box] = q.name
            shards[device] = (requested[plan_box], box)
        wanted.append((p, sharding, perm, shards))

    with or_in_process(client) as c:
        arrays = c.materialize(request) if request.params else {}
    out: dict[str, Any] = {}
    for p, sharding, perm, shards in wanted:
        array_shape = tuple(int(p.shape[a]) for a in perm)
        pieces = []
        for device, (key, box) in shards.items():
            if key is None:
                local = np.empty(tuple(b - a for a, b in box), dtype=_numpy_dtype(p.dtype))
            else:
                region_shape = tuple(b - a for a, b in _unpermute(box, perm))
                local = np.ascontiguousarray(arrays[key].reshape(region_shape).transpose(perm))
            pieces.append(jax.device_put(local, device))
        out[p.name] = jax.make_array_from_single_device_arrays(array_shape, sharding, pieces)
    return out


def _unpermute(box: Box, perm: Sequence[int]) -> Box:
    out = [(0, 0)] * len(perm)
    for i, a in enumerate(perm):
        out[a] = box[i]
    return tuple(out)


def _numpy_dtype(dtype_enum: int) -> Any:
    from paraminit import dtypes

    info = dtypes.by_enum(dtype_enum)
    if info is None:
        raise InvalidArgument(f"unknown dtype enum value {dtype_enum}")
    return info.numpy
