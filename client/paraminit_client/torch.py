"""PyTorch modules and paraminit plans: a plan from a module, and a module filled from a plan.

Build the model on the ``meta`` device (no memory, no RNG work), describe every
tensor with ``plan_from_module``, and let ``materialize_module`` fill it: one
parameter initialization for the whole model, done by the server's sampler, with
bytes the plan alone determines (same plan, same tensors, on any backend)::

    with torch.device("meta"):
        model = GPT(config)
    with Client() as client:                               # embedded CPU server
        materialize_module(model, client, seed=0)          # zero-copy SHM: a server on this host

Policies:

- ``"own"`` (the default): the model's own initialization code, replayed
  (paraminit_client.replay): every write its code makes to a tensor is recorded
  as the distribution it gives. Build the model under ``meta_parameters()`` and
  its constructor's initialization is recorded as it runs; on ``torch.device("meta")``
  each layer's ``reset_parameters`` and transformers' ``initialize_weights`` are
  replayed, and a constructor that initializes in its own code is refused.
- ``"torch"`` reproduces the distributions of PyTorch's own ``reset_parameters``
  for the layers it knows (Linear, Bilinear, Conv/ConvTranspose 1-3d, Embedding,
  EmbeddingBag, LayerNorm, RMSNorm, GroupNorm, BatchNorm/InstanceNorm,
  MultiheadAttention, RNN/LSTM/GRU and their cells, PReLU, and nn.Transformer's
  Xavier re-initialization). The distributions are PyTorch's; the values are
  paraminit's (its own generator), so they differ from ``torch.manual_seed`` runs.
- ``"torchlean"``: Kaiming-uniform (``kaimingUniformForShape``) for weights of
  rank >= 2, zeros for biases and other rank < 2 tensors of those layers,
  ones/zeros for norms, normal(0, 1) for embeddings.
- ``"hf"``: Hugging Face transformers' own ``_init_weights`` (paraminit_client.hf):
  normal(0, initializer_range) weights, zero biases, unit norms, GPT-2's scaled
  residual projections, for GPT-2, Llama, Mistral, Qwen2, BERT and every family
  using the base rules.
- ``"torchtitan"``: torchtitan's own ``param_init`` (paraminit_client.titan), read
  from each module's config-built initializers: truncated normals where it uses
  ``trunc_normal_``, RoPE caches computed by the modules themselves.

An Embedding's ``padding_idx`` row is zero under every policy (a plan patch over
the base initializer). DTensor parameters stay DTensors and each rank fills only
its shard (paraminit_client.distributed). Non-persistent buffers left on meta are
computed by the model's own code where it has some (transformers models);
otherwise build the model under ``meta_parameters()``.

A layer the policy does not know (or a known one whose class redefines its
initialization) is never guessed: ``UnsupportedModuleError`` lists every such
tensor, and ``overrides`` can supply them.

The plan's dtypes are floating point, so integer and bool buffers are not in the
plan; ``materialize_module`` sets BatchNorm's ``num_batches_tracked`` to 0, as
PyTorch does, and refuses (before any RPC) a module with any other tensor still
on ``meta`` that the plan does not cover.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

try:
    import torch
    import torch.utils.dlpack
    from torch import nn
except ImportError as _exc:  # torch is an optional extra: the rest of the client never imports it
    from paraminit_client.errors import MissingPackage

    raise MissingPackage("torch", "paraminit_client.torch") from _exc

import grpc
import numpy as np
from google.protobuf import json_format

from paraminit import dtypes, inits
from paraminit.peers import is_local_target
from paraminit.shapes import out_shape
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import distributed, hf, policies, replay
from paraminit_client.client import Client, or_in_process
from paraminit_client.delivery import Delivery
from paraminit_client.errors import InvalidArgument, ParaminitError
from paraminit_client.exports import Lease
from paraminit_client.policies import BUILT_IN, policy_of
from paraminit_client.rules import ModuleWalk, Policy, Ruling, module_names, param_seed
from paraminit_client.torch_rules import PLAN_DTYPES, TORCH_DTYPES, NormBase, numpy_to_torch, numpy_view

__all__ = [
    "LEASE_ATTR",
    "POLICIES",
    "UnsupportedModuleError",
    "lease_of",
    "materialize_module",
    "meta_parameters",
    "param_seed",
    "plan_from_constructor",
    "plan_from_module",
]

# overrides(name, tensor) or overrides(name, tensor, module, module_name): the module owning the tensor under
# `name` and its qualified name in the model ("" for the root); None leaves the tensor to the policy.
Override = Callable[..., "plan_pb2.Init | Mapping[str, Any] | None"]
POLICIES = BUILT_IN
LEASE_ATTR = "_paraminit_lease"

_SEEDED = inits.SEEDED_JSON  # JSON keys (both spellings) of the seeded kinds


class UnsupportedModuleError(InvalidArgument):
    """Tensors the policy cannot initialize without guessing; `problems` holds (name, module type, reason)."""

    def __init__(self, problems: list[tuple[str, str, str]]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {name} ({kind}): {reason}" for name, kind, reason in problems)
        super().__init__(
            f"{len(problems)} tensor(s) have no initializer under this policy; pass `overrides` "
            f"returning an Init (or its JSON form) for them:\n{lines}"
        )


# -- walking a module ---------------------------------------------------------------------


def _override_init(name: str, value: plan_pb2.Init | Mapping[str, Any], seed: int) -> plan_pb2.Init:
    """An override's Init; a JSON form without "seed" gets the parameter's derived seed."""
    if isinstance(value, plan_pb2.Init):
        return value
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"override for {name!r} must return an Init, a mapping or None, got {type(value).__name__}")
    data = {k: ({**v, "seed": seed} if k in _SEEDED and isinstance(v, Mapping) and "seed" not in v else v) for k, v in value.items()}
    init = plan_pb2.Init()
    try:
        json_format.ParseDict(data, init)
    except json_format.ParseError as exc:
        raise InvalidArgument(f"override for {name!r} is not a valid Init: {exc}") from None
    return init


def _override_arity(fn: Override) -> int:
    """4 when the callback takes (name, tensor, module, module_name), else 2 (the original form)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 2
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 4
    return 4 if len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 4 else 2


def plan_from_module(module: nn.Module, seed: int = 0, policy: str | Policy = "own", overrides: Override | None = None) -> plan_pb2.Plan:
    """One Param per distinct floating-point tensor of `module.state_dict()`, in its order.

    Names are state_dict names; a tied tensor appears once, under its first
    name, with the initialization of that name's module (for GPT-2's tied
    lm_head that is the token Embedding's; under "hf", the tie source's).
    `overrides` is asked first for every tensor, as overrides(name, tensor) or,
    when it takes four arguments, overrides(name, tensor, module, module_name)
    with the owning module and its qualified name; None leaves it to the policy.
    An override replaces the base initializer only: elements the layer fixes
    (Embedding's padding_idx row) stay fixed, as plan patches. Seeds are
    param_seed(seed, name). Works on meta modules (and DTensor parameters: global
    shapes): only shapes and dtypes are read.

    Recipe, GPT-2-style depth-scaled output projections with truncated-looking bounds::

        def scheme(name, tensor, module, module_name):
            if isinstance(module, nn.Linear) and module_name.endswith("c_proj") and name.endswith("weight"):
                bound = 0.02 / math.sqrt(2 * n_layers) * math.sqrt(3)  # uniform with normal(0, std)'s variance
                return {"uniform": {"lo": -bound, "hi": bound}}       # seed: param_seed(seed, name)
            return None

        plan = plan_from_module(model, seed=0, policy="hf", overrides=scheme)

    Args:
        module: the model (on meta, or real: only shapes and dtypes are read).
        seed: the model's seed (each parameter's is param_seed(seed, name)).
        policy: a name of paraminit_client.policies (POLICIES: "own", the default, the model's own initialization
            code replayed; "torch", PyTorch's per-layer default distributions;
            "torchlean"; "hf", transformers' initialization; "torchtitan"; the recipes "megatron", "neox",
            "olmo"; or one `policies.register`ed), or a Policy object: recipes.megatron(sigma=0.01),
            recipes.replay(lambda m: m.init_weights()), or a class of one's own with `name` and `assign(walk)`.
        overrides: asked first for every tensor; returns an Init, its JSON form, or None for the policy's.

    Returns:
        The plan, one Param per distinct floating-point tensor, in state_dict order.

    Raises:
        UnsupportedModuleError: (a ValueError) tensors the policy cannot initialize without guessing, every one.
        ValueError: an unknown policy, or an override that is not an initializer.
    """
    with _state_dict_as_parameters(module):
        return _plan_from_module(module, seed, policy, overrides)


def _plan_from_module(module: nn.Module, seed: int, policy: str | Policy, overrides: Override | None) -> plan_pb2.Plan:
    walk = ModuleWalk(module, seed)
    policy_of(policy).assign(walk)
    owners, tensors, kinds = walk.owners, walk.tensors, walk.kinds
    problems: list[tuple[str, str, str]] = []
    params: list[plan_pb2.Param] = []
    arity = _override_arity(overrides) if overrides is not None else 0
    mod_names = module_names(module) if arity == 4 else {}
    for name, t in tensors.items():
        got = walk.ruling(name)
        if overrides is not None:
            owner = owners.get(name)
            args = (name, t) if arity == 2 else (name, t, owner[0] if owner else None, mod_names.get(id(owner[0]), "") if owner else "")
            custom = overrides(*args)
            if custom is not None:
                got = Ruling.of(_override_init(name, custom, param_seed(seed, name)), walk.patches.get(name, []))
        dtype = PLAN_DTYPES.get(t.dtype)
        if dtype is None:
            problems.append((name, kinds[name], f"dtype {t.dtype} is not one of {', '.join(dtypes.NAMES)}"))
        elif not got.decided:
            problems.append((name, kinds[name], got.reason))
        else:
            params.append(plan_pb2.Param(name=name, shape=list(t.shape), dtype=dtype, init=got.init, patches=got.patches))
    if problems:
        raise UnsupportedModuleError(problems)
    return plan_pb2.Plan(params=params)


# -- materializing ------------------------------------------------------------------------


def _lease_tensors(lease: Lease) -> dict[str, torch.Tensor]:
    """Views of the lease's buffer (host mapping or device memory), typed in torch, no copy."""
    buf = lease.buffer
    base = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else torch.utils.dlpack.from_dlpack(buf)
    return {t.name: base[t.offset : t.offset + t.nbytes].view(TORCH_DTYPES[t.dtype]).view(tuple(t.shape)) for t in lease.info.tensors}


def _choose(client: Client, device: torch.device, delivery: Delivery) -> list[Delivery]:
    """Deliveries to try in order: zero-copy first when the server is on this host and offers it."""
    if delivery is not Delivery.AUTO:
        return [delivery]
    if client.in_process:
        return [Delivery.IN_PROCESS]  # the kernels write straight into the module's new tensors
    if not is_local_target(client.target):
        return [Delivery.STREAM]
    offered = set(client.info().deliveries)
    order = []
    if device.type == "cuda" and pb.DELIVERY_CUDA_IPC in offered:
        order.append(Delivery.CUDA_IPC)
    if pb.DELIVERY_SHM in offered:
        order.append(Delivery.SHM)
    return [*order, Delivery.STREAM]


def _fetch(
    client: Client, plan: plan_pb2.Plan, device: torch.device, kind: Delivery, ttl_seconds: float, auto_renew: bool | None
) -> tuple[dict[str, torch.Tensor], Lease | None]:
    if kind is Delivery.IN_PROCESS:
        host = device if device.type == "cpu" else torch.device("cpu")
        tensors = {p.name: torch.empty(out_shape(p), dtype=TORCH_DTYPES[p.dtype], device=host) for p in plan.params}
        client.materialize_into(plan, {k: numpy_view(v) for k, v in tensors.items()})
        return {k: v.to(device) for k, v in tensors.items()}, None
    if kind is Delivery.STREAM:
        tensors = {k: numpy_to_torch(v) for k, v in client.materialize(plan).items()}
        return {k: v.to(device) for k, v in tensors.items()}, None
    renew = (kind is Delivery.CUDA_IPC) if auto_renew is None else auto_renew
    lease = client.export(plan, kind, ttl_seconds=ttl_seconds, auto_renew=renew)
    try:
        tensors = _lease_tensors(lease)
        if all(t.device == device for t in tensors.values()):
            return tensors, lease
        moved = {k: v.to(device, copy=True) for k, v in tensors.items()}  # e.g. SHM to a GPU: the lease is not needed
        # GPU copies are asynchronous: finish them before release lets the server free their source
        for d in {t.device for t in (*tensors.values(), *moved.values()) if t.device.type == "cuda"}:
            torch.cuda.synchronize(d)
    except BaseException:
        lease.release()
        raise
    del tensors
    lease.release()
    return moved, None


def materialize_module(
    module: nn.Module,
    client: Client | None = None,
    *,
    device: str | torch.device = "cpu",
    delivery: Delivery | str = Delivery.AUTO,
    plan: plan_pb2.Plan | None = None,
    seed: int = 0,
    policy: str | Policy = "own",
    overrides: Override | None = None,
    ttl_seconds: float = 0.0,
    auto_renew: bool | None = None,
) -> Lease | None:
    """Replace the module's tensors (typically on meta) with real ones from the server; returns the lease, if any.

    `plan` defaults to plan_from_module(module, seed, policy, overrides).
    Delivery "auto" picks, for an in-process client (`Client()`), fills straight
    into the module's new tensors; for a server on this host, CUDA_IPC (to a cuda
    device) or SHM, and else (or when the server refuses the handoff) a STREAM
    copy; "in_process", "stream", "shm" and "cuda_ipc" force one. Tensors are assigned with
    load_state_dict(assign=True), one Parameter per distinct tensor, so tied
    weights stay tied and requires_grad is kept.

    With SHM or CUDA_IPC the module's tensors alias the leased buffer: the
    lease is returned and kept with the module (attribute LEASE_ATTR, read it
    with lease_of(module)); `lease.apply(plan2)` re-initializes the module in
    place. Copies and pickles of the module carry their own tensors and no lease.
    Under CUDA_IPC the tensors are the server's device memory, so releasing the
    lease, or letting it expire, invalidates them: it is auto-renewed by default
    and must be held as long as the module is used. Under SHM the tensors hold
    the mapping, so they stay valid after release or expiry (which only free the
    server's accounting); Apply needs a live lease. Materializing the module
    again releases the previous lease.

    Args:
        module: the model, typically built on meta (or with meta_parameters()).
        client: the Client to materialize with (in process, or a server); None: an in-process Client() for the
            call, so no delivery that leaves a lease (SHM, CUDA_IPC: the lease needs its client).
        device: where the tensors go ("cpu", "cuda", "cuda:N").
        delivery: a Delivery, or its string: "auto", "in_process", "stream", "shm" or "cuda_ipc".
        plan: the plan (default: plan_from_module(module, seed, policy, overrides)); it must name state_dict
            tensors with their exact shapes and dtypes, whole.
        seed: with no plan, the model's seed.
        policy: with no plan, the initialization policy (see plan_from_module).
        overrides: with no plan, per-tensor overrides (see plan_from_module).
        ttl_seconds: for SHM/CUDA_IPC, the lease's time to live (0: the server's default).
        auto_renew: for SHM/CUDA_IPC, renew the lease in the background (default: CUDA_IPC only).

    Returns:
        The lease holding the module's tensors (SHM, CUDA_IPC), or None (in process, STREAM).

    Raises:
        ParaminitError: the materialization failed (an invalid plan with every violation, a limit, the server).
        UnsupportedModuleError: with no plan, tensors the policy cannot initialize.
        ValueError: a delivery name, or a plan that does not match the module.

    Example:
        import torch
        from paraminit_client import Client
        from paraminit_client.torch import materialize_module

        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
        with Client() as client:  # Client("host:port") for a server
            materialize_module(model, client, seed=0, policy="torch")
        assert not model[0].weight.is_meta and model[1].weight.eq(1).all()
    """
    kind = Delivery.parse(delivery, tuple(Delivery), "auto, stream, shm, cuda_ipc or in_process")
    if client is None and kind.leases:
        raise InvalidArgument(f"delivery {kind.value!r} leaves a lease, which needs a Client that outlives the call: pass client=")
    with _state_dict_as_parameters(module), or_in_process(client) as c:
        return _materialize_module(module, c, device, kind, plan, seed, policy, overrides, ttl_seconds, auto_renew)


def _materialize_module(
    module: nn.Module,
    client: Client,
    device: str | torch.device,
    delivery: Delivery,
    plan: plan_pb2.Plan | None,
    seed: int,
    policy: str | Policy,
    overrides: Override | None,
    ttl_seconds: float,
    auto_renew: bool | None,
) -> Lease | None:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # compare like with like: tensors report cuda:N
        dev = torch.device("cuda", torch.cuda.current_device())
    if plan is None:
        plan = plan_from_module(module, seed, policy, overrides)
    state = module.state_dict(keep_vars=True)
    ids = {name: id(t) for name, t in state.items() if isinstance(t, torch.Tensor)}
    _check_plan(plan, state)
    planned = {ids[p.name] for p in plan.params}
    owners = policies.owners(module)
    _compute_transient_buffers(module, dev)
    fills: dict[int, torch.Tensor] = {}
    missing = []
    later = _buffers_computed_later(module)
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if id(t) in planned or id(t) in fills or not t.is_meta or id(t) in later:
            continue
        owner = owners.get(name)
        if owner is not None and isinstance(owner[0], NormBase) and owner[1] == "num_batches_tracked":
            fills[id(t)] = torch.zeros(t.shape, dtype=t.dtype, device=dev)  # PyTorch's reset_running_stats
        else:
            why = "not in the plan" if name in state else "a non-persistent buffer the module cannot recompute"
            missing.append(f"{name} ({t.dtype}, {why})")
    if missing:
        raise InvalidArgument(
            "these tensors are still on meta and would stay unmaterialized: "
            + ", ".join(missing)
            + ". Build the model under paraminit_client.torch.meta_parameters() instead of "
            "torch.device('meta'): parameters stay on meta, buffers are computed for real, and "
            "materialize_module fills the parameters (pass overrides for parameters a policy refuses)"
        )
    full_plan = plan
    boxes: dict[str, tuple[tuple[int, int], ...]] = {}
    if any(distributed.is_dtensor(state[p.name]) for p in plan.params):
        plan, boxes = distributed.localize(plan, state)  # this rank's shards only

    tensors: dict[str, torch.Tensor] = {}
    lease: Lease | None = None
    if plan.params:
        order = _choose(client, dev, delivery)
        for i, kind in enumerate(order):
            try:
                tensors, lease = _fetch(client, plan, dev, kind, ttl_seconds, auto_renew)
                break
            except ParaminitError as err:  # e.g. a forwarded port that looks local but is not: try the next
                if i + 1 == len(order) or err.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
    try:
        for p in full_plan.params:
            old = state[p.name]
            new = tensors.get(p.name)
            if p.name in boxes:
                new = distributed.wrap(new, old, boxes[p.name], dev)
            assert new is not None
            fills[id(old)] = nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else new
        filled: OrderedDict[str, Any] = OrderedDict(
            (name, fills.get(id(t), t) if isinstance(t, torch.Tensor) else t) for name, t in state.items()
        )
        metadata = getattr(state, "_metadata", None)  # module versions, which versioned _load_from_state_dict read
        if metadata is not None:
            filled._metadata = metadata  # type: ignore[attr-defined]
        module.load_state_dict(filled, strict=True, assign=True)
        for mod in dict.fromkeys(later.values()):  # their parameters are real now: the buffers follow them
            mod.init_non_persistent_buffers()
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    previous = lease_of(module)
    if previous is not None and previous is not lease:
        previous.release()
    if lease is None:
        module.__dict__.pop(LEASE_ATTR, None)
    else:
        setattr(module, LEASE_ATTR, _Held(lease))
    return lease


class _Held:
    """Keeps a lease alive as long as the module it filled.

    A deep copy or a pickle of the module (torch.save(model), copy.deepcopy)
    copies the tensors, so the copy needs no lease: it gets None instead of
    failing on the lease's locks and mapping.
    """

    __slots__ = ("lease",)

    def __init__(self, lease: Lease | None) -> None:
        self.lease = lease

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[type[None], tuple[()]]:
        return type(None), ()

    def __repr__(self) -> str:
        return f"<paraminit lease {self.lease.lease_id if self.lease else None}>"


_STATE_DICT_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


@contextlib.contextmanager
def _state_dict_as_parameters(module: nn.Module) -> Iterator[None]:
    """torchtitan models only: their state_dict hooks rename tensors for checkpoints (the fused wqkv saved as
    wq/wk/wv, gathered to Replicate under DTensors), so plans and fills use the parameters themselves, each
    rank's shard in place, with the hooks set aside for the duration."""
    titan_module = getattr(sys.modules.get("torchtitan.protocols.module"), "Module", None)
    if titan_module is None or not isinstance(module, titan_module):
        yield
        return
    saved = []
    for mod in module.modules():
        for attr in _STATE_DICT_HOOKS:
            hooks = mod.__dict__.get(attr)
            if hooks:
                saved.append((hooks, dict(hooks)))
                hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.update(items)


def _compute_transient_buffers(module: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers left on meta (rotary inv_freq, position ids), computed on `device` by the model's
    own code where it has some: transformers models' _init_weights (paraminit_client.hf.fill_buffers)."""
    pending: dict[str, tuple[nn.Module, str]] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for key in mod._non_persistent_buffers_set:
            b = mod._buffers.get(key)
            if b is not None and b.is_meta:
                pending[f"{prefix}.{key}" if prefix else key] = (mod, key)
    if pending and "transformers" in sys.modules:  # a transformers model implies transformers is loaded
        hf.fill_buffers(module, pending, device)
    if pending and "torchtitan" in sys.modules:  # torchtitan modules compute theirs (RoPE caches)
        from paraminit_client import titan

        titan.fill_buffers(module, device)


def _buffers_computed_later(module: nn.Module) -> dict[int, Any]:
    """Non-persistent buffers still on meta whose module computes them from its parameters' device and dtype
    (timm's init_non_persistent_buffers): id(buffer) -> the module, asked again once its parameters are real."""
    out: dict[int, Any] = {}
    for mod in module.modules():
        if not callable(getattr(mod, "init_non_persistent_buffers", None)):
            continue
        for key in mod._non_persistent_buffers_set:
            b = mod._buffers.get(key)
            if b is not None and b.is_meta:
                out[id(b)] = mod
    return out


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model with its parameters on meta and its buffers real: modules compute their buffers
    (rotary frequencies, masks, position ids) as usual, and no parameter memory or initialization is spent
    before materialize_module. Like torch.device("meta") for parameters only.

    The constructor's own initialization is recorded as it runs (paraminit_client.replay): every parameter
    carries what the model's code did to it (torchvision's and timm's loops over their modules, transformers'
    post_init, each layer's reset_parameters), so the default policy ("own") gives the model its own
    initialization with the plan's values. Only this thread's construction is recorded.

    Returns:
        A context manager: modules built inside it get meta parameters.
    """
    register = nn.Module.register_parameter
    owner = threading.get_ident()
    with replay.capture() as rec:

        def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and type(param) is nn.Parameter:
                mine = threading.get_ident() == owner  # another thread's parameters go to meta unrecorded
                initial = replay.initial_value(rec, param) if mine and not param.is_meta else None
                if not param.is_meta:
                    param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
                if mine:
                    param.__dict__[replay.RECORD_ATTR] = rec.add_root(param, initial)
            register(self, name, param)

        nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = register  # type: ignore[method-assign]


def plan_from_constructor(
    build: Callable[[], nn.Module], seed: int = 0, policy: str | Policy = "own", overrides: Override | None = None
) -> plan_pb2.Plan:
    """The plan of the model `build()` returns, built under meta_parameters() so its constructor's own
    initialization is recorded (no parameter memory is allocated).

    Args:
        build: makes the model, e.g. `lambda: torchvision.models.resnet50()`.
        seed: the model's seed (each parameter's is param_seed(seed, name)).
        policy: as for plan_from_module (default "own": the model's own initialization).
        overrides: as for plan_from_module.

    Returns:
        The plan, one Param per distinct floating-point tensor, in state_dict order.

    Raises:
        UnsupportedModuleError: tensors whose initialization has no plan form, each with the call and file:line.
        InvalidArgument: `build` returned something other than a torch.nn.Module.
    """
    with meta_parameters():
        model = build()
    if not isinstance(model, nn.Module):
        raise InvalidArgument(f"the constructor returned {type(model).__name__}, not a torch.nn.Module")
    return plan_from_module(model, seed, policy, overrides)


def lease_of(module: nn.Module) -> Lease | None:
    """The lease whose buffer holds the module's tensors (from materialize_module), or None.

    Args:
        module: a module materialize_module filled.

    Returns:
        Its Lease (SHM, CUDA_IPC), or None when its tensors are its own (in process, STREAM, never filled).
    """
    held = module.__dict__.get(LEASE_ATTR)
    return held.lease if isinstance(held, _Held) else None


def _check_plan(plan: plan_pb2.Plan, state: Mapping[str, Any]) -> None:
    """A given plan must name state_dict tensors with their exact shapes and dtypes, whole (no regions)."""
    problems = []
    for p in plan.params:
        t = state.get(p.name)
        if not isinstance(t, torch.Tensor):
            problems.append(f"{p.name!r} is not a tensor of the module's state_dict")
            continue
        if list(p.shape) != list(t.shape) or TORCH_DTYPES.get(p.dtype) != t.dtype:
            problems.append(f"{p.name!r}: plan {plan_pb2.DType.Name(p.dtype)}{list(p.shape)} but module {t.dtype}{list(t.shape)}")
        if p.region:
            problems.append(f"{p.name!r}: a region (shard) cannot fill a whole module tensor")
    if problems:
        raise InvalidArgument("plan does not match the module: " + "; ".join(problems))
