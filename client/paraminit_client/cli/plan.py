"""`paraminit plan`: a plan built from a safetensors checkpoint, or from a PyTorch module under a policy."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from paraminit_client.cli.common import EXIT_OK, Subcommands, UsageError, add_command, check_output, write_text
from paraminit_client.errors import require
from paraminit_client.plans import load_plan, plan_from_safetensors, plan_to_json

# paraminit_client.torch.POLICIES, written here so that the CLI starts without importing torch (a test holds
# the two equal)
POLICIES = ("own", "torch", "torchlean", "hf", "torchtitan", "megatron", "neox", "olmo")


def add_parser(sub: Subcommands) -> None:
    """Add `plan` to the `paraminit` parser.

    Args:
        sub: the subparsers of the `paraminit` parser.
    """
    plan = add_command(
        sub, "plan", "build a plan from a checkpoint or a PyTorch module", "Build a plan and print its JSON (or write it with -o)."
    )
    plan_sub = plan.add_subparsers(dest="plan_command", required=True, metavar="SOURCE", help="where the plan comes from")
    fs = plan_sub.add_parser(
        "from-safetensors",
        help="a plan that loads every tensor of a checkpoint",
        description="A plan that takes every tensor of the checkpoint (as safetensors "
        "references, which the server must be allowed to read: --safetensors-dirs) and "
        "initializes the other parameters of --fallback as that plan says.",
    )
    fs.add_argument("file", help="safetensors checkpoint (a path: the plan refers to it, so not -)")
    fs.add_argument(
        "--fallback",
        metavar="PLAN",
        help="plan for the parameters the checkpoint lacks; its shapes and dtypes must agree with the checkpoint's",
    )
    fs.add_argument("-o", "--output", metavar="FILE", help="write the plan here (default: stdout)")
    fs.set_defaults(func=run_from_safetensors)
    fm = plan_sub.add_parser(
        "from-module",
        help="the plan of a PyTorch module, built on the meta device",
        description="Import package.module, call factory(**args) with its parameters on the meta device (no "
        "parameter memory is allocated; its own initialization code is recorded as it runs) and print the plan of "
        "the module it returns: one parameter per distinct floating-point tensor of its state_dict, each with the "
        "initialization the model's own code gives it (policy own), e.g. `plan from-module "
        "torchvision.models:resnet50 --arg num_classes=10`. Needs PyTorch.",
    )
    fm.add_argument(
        "factory", metavar="package.module:factory", help="callable returning a torch.nn.Module; the current directory is importable"
    )
    fm.add_argument(
        "--arg",
        action="append",
        metavar="NAME=VALUE",
        help="a keyword argument of the factory (repeatable); VALUE is read as JSON where it parses (10, 0.5, true), else as a string",
    )
    fm.add_argument(
        "--seed", type=int, default=0, help="plan seed; each parameter's seed derives from it and the parameter name (default: 0)"
    )
    fm.add_argument(
        "--policy",
        choices=POLICIES,
        default="own",
        help="own: the model's own initialization code, replayed (its constructor, each layer's reset_parameters, "
        "transformers' _init_weights, timm's init_weights); torch: PyTorch's own default distributions per layer; "
        "torchlean: kaiming/xavier uniform, as TorchLean (the Lean runtime whose sampler paraminit reproduces) "
        "initializes; hf: Hugging Face "
        "transformers' own _init_weights (make extra-hf); torchtitan: torchtitan's own "
        "init_weights, read from the module (make extra-torchtitan); megatron: Megatron-LM's "
        "normal(0, sigma) with sigma / sqrt(2 L) on output projections; neox: GPT-NeoX's small_init with wang_init on "
        "output projections (both read depth and width from the model's config, or take --num-layers, --d-model, "
        "--sigma); olmo: OLMo-core's own init_weights, replayed (make extra-recipes) (default: own)",
    )
    fm.add_argument("--num-layers", type=int, metavar="L", help="megatron, neox: the model's depth, where its config does not say")
    fm.add_argument("--d-model", type=int, metavar="D", help="neox: the model's width, where its config does not say")
    fm.add_argument("--sigma", type=float, metavar="S", help="megatron: the standard deviation (default: the config's, else 0.02)")
    fm.add_argument(
        "--overrides",
        metavar="package.module:callable",
        help="asked first for every tensor: "
        "callable(name, tensor) or callable(name, tensor, module, module_name) returning an "
        "initializer as JSON ({'normal': {'std': 0.02}}) or an Init, or None to leave it to the policy",
    )
    fm.add_argument("-o", "--output", metavar="FILE", help="write the plan here (default: stdout)")
    fm.set_defaults(func=run_from_module)


def run_from_safetensors(args: argparse.Namespace) -> int:
    """The plan that loads every tensor of a checkpoint (and --fallback's for the rest).

    Args:
        args: the parsed flags.

    Returns:
        The exit code.

    Raises:
        UsageError: standard input as the checkpoint, or an output onto an input.
    """
    if args.file == "-":
        raise UsageError("a plan from a checkpoint reads its tensors from the file's path: give the path, not - (standard input)")
    if args.output and args.output != "-":
        check_output(args.output, [args.file, args.fallback])
    fallback = load_plan(args.fallback) if args.fallback else None
    write_text(plan_to_json(plan_from_safetensors(args.file, fallback)), args.output)
    return EXIT_OK


def _factory(spec: str) -> Any:
    """The callable `package.module:name` names (the current directory is importable, as for `python -m`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected package.module:factory, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise ValueError(f"{module_name} has no attribute {attr!r}; callables there: {', '.join(public) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
    return obj


def _factory_argument(text: str) -> tuple[str, Any]:
    """--arg NAME=VALUE: the value as JSON where it parses (10, 0.5, true, [1, 2], "x"), else as the string."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise UsageError(f"--arg takes NAME=VALUE (a keyword argument of the factory), got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def run_from_module(args: argparse.Namespace) -> int:
    """The plan of the PyTorch module a factory builds on the meta device, under --policy.

    Args:
        args: the parsed flags.

    Returns:
        The exit code.

    Raises:
        UsageError: a malformed factory or --arg, or a setting the policy does not take.
        ValueError: a factory that cannot be imported, called, or does not return a module.
    """
    require("torch", "plan from-module")  # before the factory's module, which imports it too
    factory = _factory(args.factory)
    import torch

    from paraminit_client.torch import meta_parameters, plan_from_module

    kwargs = dict(_factory_argument(a) for a in args.arg or [])
    with meta_parameters():  # the constructor's own initialization is recorded as it runs
        try:
            module = factory(**kwargs)
        except TypeError as exc:
            raise ValueError(f"{args.factory}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed: {exc}") from None
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"{args.factory} returned {type(module).__name__}, not a torch.nn.Module")
    overrides = _factory(args.overrides) if args.overrides else None
    policy: Any = args.policy
    settings = {"num_layers": args.num_layers, "d_model": args.d_model, "sigma": args.sigma}
    given = {k: v for k, v in settings.items() if v is not None}
    if given:
        from paraminit_client import recipes

        allowed = {"megatron": ("num_layers", "sigma"), "neox": ("num_layers", "d_model")}.get(policy, ())
        extra = [k for k in given if k not in allowed]
        if extra:
            flags = ", ".join("--" + k.replace("_", "-") for k in extra)
            raise UsageError(
                f"{flags}: not a setting of policy {policy!r} (megatron takes --num-layers and --sigma, neox --num-layers and --d-model)"
            )
        policy = getattr(recipes, policy)(**given)
    write_text(plan_to_json(plan_from_module(module, seed=args.seed, policy=policy, overrides=overrides)), args.output)
    return EXIT_OK
