"""torchvision's operator schemas where its compiled operators cannot load (PyPI's CPU-less environments).

PyPI's torchvision wheels are built against PyTorch's CUDA wheels; beside the CPU build of PyTorch their `_C`
library does not load, and `import torchvision` then fails registering fake kernels for `torchvision::nms` and
`torchvision::qnms` ("operator torchvision::nms does not exist"). Model code (torchvision.models, timm, transformers'
vision models) needs none of those operators. This module, imported at interpreter start by
`paraminit-torchvision-ops.pth` (the Makefile's `make zoo-extra` puts both in the virtual environment), waits for
torchvision's own import and, only when its compiled library did not load, declares the two schemas (no kernels) so
the import completes; calling them still fails. torchvision itself is not changed, and nothing is imported before
torchvision is.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any


class _DeclareOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name != "torchvision._meta_registrations":
            return None
        import torch

        try:
            torch.ops.torchvision.nms  # noqa: B018 - the compiled library loaded: nothing to declare
        except (AttributeError, RuntimeError):
            lib = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _DeclareOps.lib = lib  # type: ignore[attr-defined]  # kept alive: dropping it removes the schemas
        return None


if not any(isinstance(f, _DeclareOps) for f in sys.meta_path):
    sys.meta_path.insert(0, _DeclareOps())
