"""Where FSDP2 lives in the installed torch, imported on first use.

``torch.distributed.fsdp`` exports ``fully_shard``, ``MixedPrecisionPolicy`` and
``FSDPModule`` since torch 2.6; torch 2.5 (ampkit's floor) has them in
``torch.distributed._composable.fsdp``. Importing either costs about a second, so
``import ampkit`` does not: the first ``fsdp_policy``/``shard`` call does.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_PUBLIC = "torch.distributed.fsdp"  # since 2.6
_COMPOSABLE = "torch.distributed._composable.fsdp"  # 2.5
_NAMES = ("fully_shard", "MixedPrecisionPolicy", "FSDPModule")


def fsdp2() -> ModuleType:
    """The module holding ``fully_shard``, ``MixedPrecisionPolicy`` and ``FSDPModule``."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("ampkit.distributed needs torch.distributed, which this torch build "
                           "lacks; valid: a torch build with distributed support (the pip wheels)")
    for path in (_PUBLIC, _COMPOSABLE):
        try:
            module = importlib.import_module(path)
        except ImportError:
            continue
        if all(hasattr(module, name) for name in _NAMES):
            return module
    raise RuntimeError(f"ampkit.distributed needs FSDP2 ({', '.join(_NAMES)}) from {_PUBLIC} or "
                       f"{_COMPOSABLE}, which this torch lacks; valid: torch 2.5 or newer")
