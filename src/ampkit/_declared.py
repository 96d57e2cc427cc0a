"""What a transformers model declares must stay fp32, and the warning when a policy would
cast it.

transformers keeps the parameters and buffers that a model's ``_keep_in_fp32_modules``
names in fp32 when it loads the model in fp16 (T5's ``wo`` layers overflow there), and
those ``_keep_in_fp32_modules_strict`` names in bf16 too (DeepSeek-V3's router bias
``e_score_correction_bias``). An entry is whole dotted components of a parameter's or
buffer's name (``"wo"``, ``"gate.weight"``), as transformers matches it. apex's O2 cast
them; ampkit casts them too unless asked (``keep_fp32``), and says so.
"""

from __future__ import annotations

import itertools
import re
from typing import Iterable

import torch
from torch import nn

from ._select import matching
from ._warn import warn_once

# (attribute, the half dtypes transformers keeps its entries fp32 in)
_DECLARED = (("_keep_in_fp32_modules", (torch.float16,)),
             ("_keep_in_fp32_modules_strict", (torch.float16, torch.bfloat16)))


def warn_declared_fp32(model: nn.Module, kept: Iterable[str], half: torch.dtype) -> None:
    """Warn where ``model`` declares parameters fp32 that a policy casting to ``half``
    would cast, outside the ``kept`` modules; the warning gives the ``keep_fp32`` patterns
    of the modules holding them."""
    inside = {id(m) for name in kept for m in model.get_submodule(name).modules()}
    for attribute, dtypes in _DECLARED:
        entries = getattr(model, attribute, None)
        if half not in dtypes or not isinstance(entries, (list, tuple, set)):
            continue
        entries = [e for e in entries if isinstance(e, str) and e]
        tensors = _declared_tensors(model, entries, inside)
        if tensors:
            warn_once(("declared-fp32", type(model).__name__, half),
                      _message(model, attribute, entries, tensors, half))


def _declared_tensors(model: nn.Module, entries: list[str],
                      inside: set[int]) -> dict[str, str]:
    """{floating parameter or buffer name: the module holding it} for those an entry
    names, outside the kept modules (each tensor once, under its first name)."""
    patterns = [re.compile(rf"(?:^|\.){re.escape(e)}(?=$|\.)") for e in entries]
    modules = dict(model.named_modules())
    found: dict[str, str] = {}
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if not tensor.is_floating_point():
            continue
        owner = name.rpartition(".")[0]
        if id(modules[owner]) in inside:
            continue
        for pattern in patterns:
            match = pattern.search(name)
            if match is not None:
                # An entry that ends inside the name names a module ("wo" in
                # "block.0.wo.weight"): that module; else the tensor's own module.
                found[name] = owner if match.end() == len(name) else name[:match.end()]
                break
    return found


def _message(model: nn.Module, attribute: str, entries: list[str], tensors: dict[str, str],
             half: torch.dtype) -> str:
    owners = sorted({m for m in tensors.values() if m})
    top = [m for m in owners if not any(m.startswith(f"{o}.") for o in owners)]
    head = (f"ampkit: {type(model).__name__} declares {attribute}={entries!r}: transformers "
            f"keeps those fp32 when it loads the model in {half} (they can overflow or lose "
            f"precision there), but this policy casts {len(tensors)} of them "
            f"({next(iter(tensors))!r}, ...) to {half}")
    if not top:
        return (head + "; they belong to the model itself, and keep_fp32 keeps whole modules: "
                "only keeping the whole model ('') would keep them")
    patterns = _patterns(model, top)
    return (head + f"; to keep them fp32 (with the rest of the modules holding them), pass "
            f"keep_fp32={patterns!r} to ampkit.initialize (or call ampkit.keep_fp32(model, "
            f"{patterns!r}) first)")


def _patterns(model: nn.Module, names: list[str]) -> list[str]:
    """``keep_fp32`` patterns selecting exactly ``names``: one ``*.<last>`` per last name
    component where that selects no other module, else the names themselves."""
    patterns = sorted({f"*.{n.rpartition('.')[2]}" if "." in n else n for n in names})
    chosen = {hit for pattern in patterns for hit in matching(model, pattern)}
    return patterns if chosen == set(names) else names
