"""What ``autotune`` returns: the choice, its measurements, and :meth:`TuneResult.apply`,
which configures a model and optimizer as chosen (as ``ampkit.initialize`` would, through
``apply.Plan.activate``). ``tune.py`` measures; this module holds the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .apply import plan
from .fp8 import convert_to_fp8
from .fp8.config import FP8_BASE_POLICY, fp8_policy_recipe
from .fp8.convert import eligible_linears, selecting
from .keep import kept_names

FP8_COMPUTE = FP8_BASE_POLICY  # what runs around the fp8 layers (and what they replace)


def fp8_recipe(name: str) -> Optional[str]:
    """The convert_to_fp8 recipe of an fp8 candidate name, None for any other policy
    (and for a malformed fp8 name, which :func:`check_candidate` refuses)."""
    try:
        return fp8_policy_recipe(name)
    except ValueError:
        return None


# The keys of a TuneResult row (the contract's); the rest of a candidate's measurement goes
# to TuneResult.details.
ROW_KEYS = ("policy", "step_ms", "peak_mib", "max_loss_dev", "accepted", "reason")


@dataclass
class TuneResult:
    """What :func:`autotune` measured and chose.

    Attributes:
        policy: the chosen policy's name (an fp8 choice: its candidate name, e.g. "fp8",
            meaning bf16 autocast with ``fp8_modules`` in fp8).
        keep_fp32: module names kept in fp32 by the choice (none chosen this way yet).
        fp8_modules: module names the choice runs in fp8 (measured faster there).
        rows: one dict per candidate with exactly the keys "policy", "step_ms" (median),
            "peak_mib" (CUDA's allocator; None on a CPU), "max_loss_dev", "accepted",
            "reason".
        speedup: fp32's step time over the chosen one's (1.0 for "32-true").
        details: one dict per candidate, in the rows' order, with the rest of what was
            measured: "policy", "timed_ms"/"timed_steps" (the sum and number of its timed
            steps) and, for an fp8 candidate, "fp8_modules" and "fp8_layers" (each
            layer's GEMM timing).
    """

    policy: str
    rows: list[dict[str, Any]]
    speedup: float
    keep_fp32: list[str] = field(default_factory=list)
    fp8_modules: list[str] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "keep_fp32": list(self.keep_fp32),
                "fp8_modules": list(self.fp8_modules), "speedup": self.speedup,
                "rows": [dict(row) for row in self.rows],
                "details": [dict(detail) for detail in self.details]}

    def apply(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None
              ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        """Configure ``model`` (and ``optimizer``) as chosen, as ``ampkit.initialize`` does.

        Everything is checked before anything changes. The chosen policy becomes the active
        amp state, as after ``initialize`` with it (its loss scaler, dynamic for fp16), so
        the apex-style loop trains as it would there. An fp8 choice converts exactly
        ``fp8_modules`` (``convert_to_fp8``; a name that is no fp8-eligible Linear of
        ``model`` raises ValueError) and applies bf16-mixed around them.

        Example:
            >>> model, optimizer = result.apply(model, optimizer)  # doctest: +SKIP
            >>> with ampkit.scale_loss(loss_fn(model(x), y), optimizer) as scaled_loss:  # doctest: +SKIP
            ...     scaled_loss.backward()
            >>> optimizer.step()  # doctest: +SKIP
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"TuneResult.apply takes the torch.nn.Module autotune measured, got "
                            f"{type(model).__name__} {model!r:.80}")
        recipe = fp8_recipe(self.policy)
        application = plan(FP8_COMPUTE if recipe is not None else self.policy, model, optimizer,
                           keep_fp32=self.keep_fp32 if self.keep_fp32 else None)
        if recipe is not None:
            kept = (application.keep_fp32[0] if application.keep_fp32 is not None
                    else kept_names(model))
            _check_fp8_modules(model, self.fp8_modules, kept)
            # Checks before its first swap; the plan above holds the same parameters after it.
            # (A bare Linear comes back converted: a new module with the same parameters.)
            model = convert_to_fp8(model, recipe=recipe,
                                   module_filter=selecting(model, self.fp8_modules))
        application.activate()
        return model, optimizer


def _check_fp8_modules(model: nn.Module, names: Sequence[str], kept: Sequence[str]) -> None:
    """Each of ``names`` an fp8-eligible Linear of ``model`` outside the ``kept`` (fp32)
    modules, which would go on computing in fp8 behind fp32 outputs (ValueError otherwise).
    Inside is by identity, as keep_fp32 and convert_to_fp8 decide it."""
    holder = {id(sub): name for name in kept for sub in model.get_submodule(name).modules()}
    valid = [name for name, layer in eligible_linears(model) if id(layer) not in holder]
    bad = [name for name in names if name not in valid]
    if bad:
        modules = dict(model.named_modules())
        why = next((f" ({name!r} is kept in fp32, in {holder[id(modules[name])]!r})"
                    for name in bad if name in modules and id(modules[name]) in holder), "")
        raise ValueError(f"fp8_modules {bad!r} name no fp8-eligible Linear of the model outside "
                         f"its kept fp32 modules{why}; valid: "
                         f"{', '.join(repr(name) for name in valid) or 'none (no eligible Linear)'}")
