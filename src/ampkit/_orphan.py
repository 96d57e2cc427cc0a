"""Copies of an initialized optimizer that lost ampkit's wrapper, refused at their step.

``copy.deepcopy`` and pickle keep only an optimizer's defaults, state and param_groups: a
copy of an O2 optimizer would update copies of the fp32 masters that never reach the
model. Such a copy is refused (RuntimeError) at its first ``step()``, by one global
optimizer step pre-hook installed with the first masters.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ._torch_compat import register_optimizer_step_pre_hook
from .master import MASTER_MARK

ATTR = "_amp_stash"  # the attribute that links an optimizer to its ampkit state (AmpStash)
_ORPHAN_HOOK: list[Any] = []
_IS_ORPHAN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()


def is_orphan(optimizer: torch.optim.Optimizer) -> bool:
    """True for an optimizer that steps ampkit masters without ampkit's wrapper (a copy)."""
    if ATTR in optimizer.__dict__:
        return False
    orphan = _IS_ORPHAN.get(optimizer)
    if orphan is None:
        orphan = _IS_ORPHAN[optimizer] = any(
            getattr(p, MASTER_MARK, False) for g in optimizer.param_groups for p in g["params"])
    return orphan


ORPHAN_MESSAGE = (
    "{name} steps copies of ampkit fp32 master weights but is not linked to any model: "
    "copy.deepcopy and pickle keep only an optimizer's defaults, state and param_groups, so "
    "the copy would update masters that never reach the model. Valid: copy.deepcopy the "
    "model and optimizer before ampkit.initialize, or build a new optimizer over the copied "
    "model and pass both to ampkit.initialize")


def _refuse_orphan(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if is_orphan(optimizer):
        raise RuntimeError(ORPHAN_MESSAGE.format(name=type(optimizer).__name__))


def refuse_orphans_once() -> None:
    """Install the pre-hook that refuses orphans' steps (once per process)."""
    if not _ORPHAN_HOOK:
        _ORPHAN_HOOK.append(register_optimizer_step_pre_hook(_refuse_orphan))
