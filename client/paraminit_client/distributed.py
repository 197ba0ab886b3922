"""Sharded initialization that does not depend on the topology: each rank asks for its own region.

A paraminit value depends only on (initializer, global index), so the shard a
rank holds under any layout (FSDP2's ``fully_shard``, tensor parallelism's
``parallelize_module``, a hand-written split) can be filled with exactly the
bytes of the single-device tensor, and nothing else is allocated or generated:

- ``materialize_module`` keeps DTensor parameters as DTensors (same mesh,
  placements, global shape and stride) and asks the server only for this
  rank's box (``local_region``): meshes of any rank, ``Shard(d)`` on any
  dimension (several mesh dimensions may shard the same tensor dimension),
  ``Replicate``, and uneven shards (torch.chunk's split; an empty shard
  allocates nothing). ``_StridedShard`` (interleaved, not a box) and
  ``Partial`` are refused.
- ``materialize_region`` is for code that shards by hand: a plan Param of the
  global tensor and a region in, the local tensor out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from paraminit.v1 import plan_pb2
from paraminit_client.client import Client, or_in_process
from paraminit_client.errors import InvalidArgument
from paraminit_client.plans import set_region
from paraminit_client.torch_rules import TORCH_DTYPES, numpy_to_torch

__all__ = ["is_dtensor", "local_region", "localize", "materialize_region", "wrap"]

Region = tuple[tuple[int, int], ...]


def _dtensor_module() -> Any:
    """torch.distributed.tensor, or None on builds without distributed support."""
    try:
        import torch.distributed.tensor as dt
    except ImportError:
        return None
    return dt


def is_dtensor(t: Any) -> bool:
    dt = _dtensor_module()
    return dt is not None and isinstance(t, dt.DTensor)


def local_region(shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> Region:
    """This rank's box of a tensor of global `shape` under (mesh, placements): one (start, stop) per dim.

    A dimension may come out empty (start == stop) on ranks past the end of an uneven split.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dt = _dtensor_module()
    for pl in placements:
        if type(pl).__name__ == "_StridedShard":
            raise InvalidArgument(
                f"{pl}: strided sharding interleaves rows, so a rank's shard is not one box; "
                "materialize the tensor before sharding it this way"
            )
        if not isinstance(pl, dt.Shard | dt.Replicate):
            raise InvalidArgument(f"{pl}: only Shard and Replicate placements can be initialized")
    local, offset = compute_local_shape_and_global_offset(tuple(shape), mesh, list(placements))
    return tuple((int(o), int(o) + int(n)) for o, n in zip(offset, local, strict=True))


def localize(plan: plan_pb2.Plan, state: Mapping[str, Any]) -> tuple[plan_pb2.Plan, dict[str, Region]]:
    """The plan this rank asks for: each DTensor's Param restricted to the rank's box, empty shards left
    out; returns it with {name: box} of every DTensor parameter (the shape wrap() needs)."""
    out = plan_pb2.Plan()
    boxes: dict[str, Region] = {}
    for p in plan.params:
        t = state[p.name]
        if not is_dtensor(t):
            out.params.append(p)
            continue
        box = local_region(t.shape, t.device_mesh, t.placements)
        boxes[p.name] = box
        if all(b > a for a, b in box):
            q = out.params.add()
            q.CopyFrom(p)
            set_region(q, box)
    return out, boxes


def wrap(local: torch.Tensor | None, like: Any, box: Region, device: torch.device) -> Any:
    """A DTensor with `like`'s mesh, placements, global shape and stride around this rank's local tensor
    (None: an empty shard, allocated here with no elements)."""
    dt = _dtensor_module()
    if local is None:
        local = torch.empty(tuple(b - a for a, b in box), dtype=like.dtype, device=device)
    return dt.DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


def materialize_region(
    param: plan_pb2.Param, region: Sequence[tuple[int, int] | slice], client: Client | None = None, *, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """The `region` box (one (start, stop) or slice per dimension) of the global tensor `param` describes,
    as a tensor of the region's shape on `device`: the same bytes as slicing the whole tensor, with only
    the region generated and allocated. `param` is typically one of plan_from_module(model_on_meta).params.

    Args:
        param: the whole tensor's Param (no region of its own).
        region: one (start, stop) pair or step-1 slice per dimension.
        client: the Client to materialize with (in process, or a server); None: an in-process Client() for the call.
        device: where the tensor goes.

    Returns:
        The region, of the region's shape and the plan's dtype.

    Raises:
        ValueError: a region of another rank, or a slice with a step.
        ParaminitError: the server refused the parameter or failed.

    Example:
        from paraminit_client import Client, param
        from paraminit_client.distributed import materialize_region

        w = param("w", [64, 32], {"normal": {"std": 0.02, "seed": 7}})
        with Client() as client:
            rows = materialize_region(w, [(16, 32), slice(None)], client)  # this rank's rows only
            assert rows.shape == (16, 32)
    """
    shape = [int(d) for d in param.shape]
    if len(region) != len(shape):
        raise InvalidArgument(f"region has {len(region)} ranges but {param.name!r} has rank {len(shape)}")
    box = []
    for r, dim in zip(region, shape, strict=True):
        if isinstance(r, slice):
            start, stop, step = r.indices(dim)
            if step != 1:
                raise InvalidArgument("region slices must have step 1")
            box.append((start, max(start, stop)))
        else:
            box.append((int(r[0]), int(r[1])))
    if any(b <= a for a, b in box):
        return torch.empty(tuple(max(0, b - a) for a, b in box), dtype=TORCH_DTYPES[param.dtype], device=device)
    q = plan_pb2.Param()
    q.CopyFrom(param)
    set_region(q, box)
    with or_in_process(client) as c:
        arrays = c.materialize(plan_pb2.Plan(params=[q]))
    return numpy_to_torch(arrays[q.name]).reshape(tuple(b - a for a, b in box)).to(device)
