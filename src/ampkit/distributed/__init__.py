"""Policies across processes: FSDP2 sharding, DCP checkpoints (torchrun; gloo or nccl).

- :func:`fsdp_policy`: the FSDP2 ``MixedPrecisionPolicy`` that carries out a policy.
- :func:`shard`: ``fully_shard`` per block and at the root under a policy (instead of
  ``ampkit.initialize``, which refuses a sharded model).
- :class:`TrainState`: model, optimizer and GradScaler as one ``torch.distributed.checkpoint``
  ``Stateful``, for an exact resume.
- :func:`load_checkpoint`: ``dcp.load`` that reads into copies, so a damaged checkpoint is
  refused with the live model, optimizer and scaler unchanged.
- :func:`is_sharded`: whether a model holds FSDP2 modules or DTensor parameters.

DDP needs nothing from here: ``initialize`` (or autocast + GradScaler) first, then wrap
the model in ``DistributedDataParallel``. A GradScaler needs no ``process_group`` under
FSDP2: unscaling DTensor gradients all-reduces found-inf over their shards (torch's
DTensor rule for ``_amp_foreach_non_finite_check_and_unscale_``), so every rank skips
together; under HSDP an inf written into one replica's gradients after backward reaches
the others only through ``GradScaler(process_group=...)``. See docs/distributed.md.
"""

from .._sharding import is_sharded
from .checkpoint import TrainState, load_checkpoint
from .fsdp import fsdp_policy, shard

__all__ = ["fsdp_policy", "shard", "TrainState", "load_checkpoint", "is_sharded"]
