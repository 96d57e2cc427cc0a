"""What a transformers model declares must stay fp32, and the warning when a policy would
cast it.

transformers keeps the parameters and buffers that a model's ``_keep_in_fp32_modules``
names in fp32 when it loads the model in fp16 (T5's ``wo`` layers overflow there), and
those ``_keep_in_fp32_modules_strict`` names in bf16 too (DeepSeek-V3's router bias
``e_score_correction_bias``). An entry is whole dotted components of a parameter's or
buffer's name (``"wo"``, ``"gate.weight"``), as transformers matches it. apex's O2 cast
them; ampkit casts them too unless asked (``keep_fp32``), and says so. The model may be
anywhere in what ``initialize`` is given (inside a wrapper with a task head).
"""

from __future__ import annotations

import itertools
import re
from typing import Iterable, Optional

import torch
from torch import nn

from ._select import patterns_selecting
from ._warn import warn_once

# (attribute, the half dtypes transformers keeps its entries fp32 in)
_DECLARED = (("_keep_in_fp32_modules", (torch.float16,)),
             ("_keep_in_fp32_modules_strict", (torch.float16, torch.bfloat16)))


def warn_declared_fp32(model: nn.Module, kept: Iterable[str], half: torch.dtype) -> None:
    """Warn where ``model`` (or a model inside it) declares parameters fp32 that a policy
    casting to ``half`` would cast, outside the ``kept`` modules; the warning gives the
    ``keep_fp32`` patterns of the modules holding them."""
    inside = {id(m) for name in kept for m in model.get_submodule(name).modules()}
    declarations: list[str] = []
    # {tensor name: (the module holding it, or None for the declaring model's own; that
    # declaring model)}, in model order
    tensors: dict[str, tuple[Optional[str], str]] = {}
    for prefix, module in model.named_modules():
        for attribute, dtypes in _DECLARED:
            entries = getattr(module, attribute, None)
            if half not in dtypes or not isinstance(entries, (list, tuple, set)):
                continue
            entries = sorted(e for e in entries if isinstance(e, str) and e)  # a set, too
            found = _declared_tensors(module, prefix, entries, inside)
            if found and not found.keys() <= tensors.keys():
                where = (f"{type(model).__name__}'s {prefix!r} ({type(module).__name__})"
                         if prefix else type(model).__name__)
                declarations.append(f"{where} declares {attribute}={entries!r}")
            tensors.update(found)
    if tensors:
        warn_once(("declared-fp32", type(model).__name__, half, tuple(tensors)),
                  _message(model, declarations, tensors, half))


def _declared_tensors(module: nn.Module, prefix: str, entries: list[str], inside: set[int]
                      ) -> dict[str, tuple[Optional[str], str]]:
    """{floating parameter or buffer name in the model: (the module holding it, None where
    that is ``module`` itself; ``prefix``)} for those of ``module`` (at ``prefix``) an
    entry names, outside the kept modules."""
    patterns = [re.compile(rf"(?:^|\.){re.escape(e)}(?=$|\.)") for e in entries]
    modules = dict(module.named_modules())
    lead = f"{prefix}." if prefix else ""
    found: dict[str, str] = {}
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
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
                holder = owner if match.end() == len(name) else name[:match.end()]
                found[lead + name] = (lead + holder if holder else None, prefix)
                break
    return found


def _message(model: nn.Module, declarations: list[str],
             tensors: dict[str, tuple[Optional[str], str]], half: torch.dtype) -> str:
    owners = sorted({m for m, _ in tensors.values() if m is not None})
    top = [m for m in owners if not any(m.startswith(f"{o}.") for o in owners)]
    own = [name for name, (owner, _) in tensors.items() if owner is None]
    declaring = sorted({prefix for owner, prefix in tensors.values() if owner is None})
    text = (f"ampkit: {' and '.join(declarations)}: transformers "
            f"keeps those fp32 when it loads the model in {half} (they can overflow or lose "
            f"precision there), but this policy casts {len(tensors)} of them "
            f"({next(iter(tensors))!r}, ...) to {half}")
    if top:
        patterns = patterns_selecting(model, top)
        text += (f"; to keep them fp32 (with the rest of the modules holding them), pass "
                 f"keep_fp32={patterns!r} to ampkit.initialize (or call "
                 f"ampkit.keep_fp32(model, {patterns!r}) first)")
    if own:
        whole = ("the whole model ('')" if declaring == [""] else
                 f"the whole of {', '.join(repr(p) for p in declaring)}")
        text += (f"; {own!r} belong{'s' if len(own) == 1 else ''} to the declaring model "
                 f"itself, and keep_fp32 keeps whole modules: only keeping {whole} would keep "
                 f"{'it' if len(own) == 1 else 'them'}")
    return text
