"""Whether a model is sharded (FSDP2): one test, for the modules that refuse or adapt to it
(apply, keep, distributed), below all of them."""

from __future__ import annotations

import sys

from torch import nn


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 (``fully_shard``) modules or DTensor parameters.

    Looks only at the torch modules already imported: a model cannot be sharded unless
    they were, and importing them costs about a second.
    """
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules()):
        return True
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())
