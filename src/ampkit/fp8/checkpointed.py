"""Delayed-recipe fp8 scales under activation checkpointing (non-reentrant).

A checkpointed forward records its amaxes as usual and keeps the ones its input and
weight scales came from, with the checkpointed call (its frame, freed with its graph);
each recomputation of that call (one per backward) casts a layer's n-th call by the n-th
kept pair and records nothing. So the fp8 tensors a recomputation makes are those the
forward made, and the histories hold one entry per step, as without checkpointing.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .._torch_compat import checkpoint_call

Scales = tuple[Tensor, ...]
# Per checkpointed call: each layer's kept amax pairs, in call order (by id of the layer);
# and per (backward, layer) how many of them that backward's recomputations used.
_KEPT: "weakref.WeakKeyDictionary[Any, dict[int, list[list[Tensor]]]]" = weakref.WeakKeyDictionary()
_USED: "weakref.WeakKeyDictionary[Any, dict[tuple[int, int], int]]" = weakref.WeakKeyDictionary()


def checkpointed_scales(layer: Any, current: Callable[[], Scales]
                        ) -> tuple[Optional[list[Tensor]], Optional[Scales]]:
    """(used, fixed) for a delayed-recipe layer's forward.

    ``used``: in a checkpointed forward, a list its casts append their amaxes to (kept
    with the call); ``fixed``: in a recomputation, the amaxes to cast by instead of the
    histories, recording nothing (``current()``: the histories' own, where nothing was
    kept because the forward ran where no view of checkpoint was). (None, None) outside
    checkpointing and with grad off.
    """
    if not torch.is_grad_enabled():
        return None, None
    call = checkpoint_call()
    if call is None:
        return None, None
    if call.phase == "forward":
        used: list[Tensor] = []
        _KEPT.setdefault(call.frame, {}).setdefault(id(layer), []).append(used)
        return used, None
    kept = _KEPT.get(call.frame, {}).get(id(layer), [])
    counts = _USED.setdefault(call.frame, {})
    n = counts.get((call.backward, id(layer)), 0)
    counts[(call.backward, id(layer))] = n + 1
    if n < len(kept) and len(kept[n]) == 2:
        return None, tuple(kept[n])
    return None, current()


def pending_calls() -> int:
    """Checkpointed calls whose kept scales are still alive (tests: they go with graphs)."""
    return len(_KEPT) + len(_USED)
