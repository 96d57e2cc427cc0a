"""Selecting a model's modules by name, fnmatch pattern, class or callable: the one rule
``keep_fp32`` and ``distributed.shard`` both follow (a module reached under two names,
``self.dec = self.enc``, matches by either and is named as ``named_modules()`` names it).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Sequence, Union

from torch import nn

Selector = Union[str, type, Callable[[str, nn.Module], bool]]
Modules = Union[Selector, Sequence[Selector]]

__all__ = ["Matcher", "Modules", "Selector", "as_selectors", "matching", "patterns_selecting"]


def matching(model: nn.Module, selector: Selector) -> list[str]:
    """The modules of ``model`` one (checked) selector matches, in model order, each under
    the one name ``named_modules()`` gives it (the root is ""). Every name of a module
    counts: one used twice (``self.dec = self.enc``) matches by either. ``keep_fp32`` and
    ``distributed.shard`` select modules by this one rule."""
    return Matcher(model).hits(selector)


class Matcher:
    """:func:`matching` for many selectors over one model: its modules are listed once,
    and a plain name (no ``*``, ``?`` or ``[``) is looked up, not compared with every
    name (``keep_fp32`` of 800 names walked the model 1600 times)."""

    def __init__(self, model: nn.Module) -> None:
        self.canonical = {id(module): name for name, module in model.named_modules()}
        self.named = list(model.named_modules(remove_duplicate=False))
        self.by_name = {name: module for name, module in self.named}

    def hits(self, selector: Selector) -> list[str]:
        if isinstance(selector, str) and not any(c in selector for c in "*?["):
            module = self.by_name.get(selector)
            return [] if module is None else [self.canonical[id(module)]]
        found = {self.canonical[id(module)] for name, module in self.named
                 if _matches(selector, name, module)}
        return [name for name in self.canonical.values() if name in found]


def patterns_selecting(model: nn.Module, names: list[str]) -> list[str]:
    """``keep_fp32`` patterns selecting exactly ``names`` (for advice): one ``*.<last>``
    per last name component where that selects no other module, else the names."""
    patterns = sorted({f"*.{n.rpartition('.')[2]}" if "." in n else n for n in names})
    matcher = Matcher(model)
    chosen = {hit for pattern in patterns for hit in matcher.hits(pattern)}
    return patterns if chosen == set(names) else names


def as_selectors(modules: Modules, what: str = "keep_fp32: ") -> list[Selector]:
    """``modules`` as a list of selectors, each checked (TypeError names a bad one, after
    ``what``: the caller and argument)."""
    items = list(modules) if isinstance(modules, (list, tuple, set, frozenset)) else [modules]
    for item in items:
        ok = isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))
        if not ok and not (callable(item) and not isinstance(item, (type, nn.Module))):
            raise TypeError(f"{what}{item!r} is not a module selector; valid: a module "
                            "name or fnmatch pattern (str), an nn.Module subclass, or a "
                            "callable (name, module) -> bool")
    return items


def _matches(selector: Selector, name: str, module: nn.Module) -> bool:
    if isinstance(selector, str):
        return name == selector or fnmatch.fnmatchcase(name, selector)
    if isinstance(selector, type):
        return isinstance(module, selector)
    return bool(selector(name, module))
