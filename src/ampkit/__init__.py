"""ampkit: automatic mixed precision for PyTorch.

torch.amp-compatible ``autocast`` and ``GradScaler``, apex.amp-compatible opt levels
O0-O3 with fp32 master weights, fp8 linear layers, and precision policies.
"""


__version__ = "0.1.0"

# Subpackage: fp8 linear layers (ampkit.fp8.convert_to_fp8, ampkit.fp8.Float8Linear)
from . import fp8

# Subpackage: FSDP2 sharding and DCP checkpoints (ampkit.distributed.shard, .fsdp_policy)
from . import distributed

# Subpackage: diagnostics (ampkit.diagnose.inspect per-module report, ampkit.diagnose.watch)
from . import diagnose

# Apex-style: opt levels, loss scaling, master weights, amp checkpoints
from .frontend import initialize, load_state_dict, master_params, scale_loss, state_dict
from .frontend import _amp_state  # noqa: F401 - apex's private attribute, read by apex clients

# Policies, per-module precision, and choosing one by measuring
from .keep import keep_fp32
from .policy import Policy, get_policy
from .tune import TuneResult, autotune

# Torch-style: gradient scaling
from .scaler import GradScaler, ScalerStats

# Torch-style: autocast and op overrides
from .autocast import autocast
from .checkpointing import checkpoint_context_fn
from .overrides import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)

__all__ = [
    "__version__",
    # policies
    "Policy",
    "get_policy",
    "keep_fp32",
    "autotune",
    "TuneResult",
    # torch-style
    "autocast",
    "GradScaler",
    "ScalerStats",
    # apex-style
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    # fp8
    "fp8",
    # distributed
    "distributed",
    # diagnostics
    "diagnose",
    # op overrides
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
    "disable_casts",
    "checkpoint_context_fn",
]
