"""What one training loop needs from a policy, and the step every bench and train run takes.

One loop serves every policy because the pieces a policy does not use are no-ops
(nanoGPT's habit): ``ampkit.apply.apply_policy`` (the seam ``initialize`` uses) converts
the model and optimizer as the policy says, ``autocast`` is entered with
``enabled=policy.autocast``, and the ``GradScaler`` (``apply.loop_scaler``) is disabled
unless the policy scales the loss. fp8 is ``convert_to_fp8`` plus bf16 autocast.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn

from .._batch import call_model
from .._dtypes import fp8_supported
from ..apply import apply_policy, loop_scaler
from ..autocast import autocast
from ..fp8 import Float8Config, Float8Linear, convert_to_fp8
from ..policy import Policy
from .policies import PolicySpec

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
_F32, _F16 = torch.float32, torch.float16


class Precision:
    """What one training loop needs from a policy; pieces it does not use are no-ops.

    Args:
        spec: the resolved policy.
        device: where the model runs.

    Example:
        >>> from ampkit.bench.policies import parse_policy
        >>> prec = Precision(parse_policy("bf16-mixed", "cpu"), torch.device("cpu"))
        >>> model, opt = prec.setup(nn.Linear(4, 4), lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> with prec.autocast:  # the matmul runs in bf16; the policy's output is fp32
        ...     model(torch.ones(2, 4)).dtype
        torch.float32
    """

    def __init__(self, spec: PolicySpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        policy = spec.policy
        # Built once: entering the same region every step costs no per-step setup.
        self.autocast = autocast(device.type, dtype=policy.compute_dtype if policy.autocast
                                 else _F32, enabled=policy.autocast)
        self.scaler = loop_scaler(policy, device.type)
        self.fp8_layers = 0

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model, convert it (fp8, half), and build its optimizer."""
        model = self.place(model)
        optimizer = make_optimizer(model.parameters())
        apply_policy(self.spec.policy, model, optimizer)
        return model, optimizer

    def place(self, model: nn.Module) -> nn.Module:
        """The model on the device, its Linear layers in fp8 where the policy asks."""
        model = model.to(self.device)
        if self.spec.fp8_recipe is not None:
            # Emulation asked for explicitly where there is no fp8 hardware: the report
            # says so, so the library's one-time warning would only repeat it.
            emulate = None if fp8_supported(str(self.device)) else True
            model = convert_to_fp8(model, recipe=Float8Config(self.spec.fp8_recipe, emulate=emulate))
            self.fp8_layers = sum(isinstance(m, Float8Linear) for m in model.modules())
        return model


def adam_eps(policy: Policy) -> float:
    """AdamW's eps for a policy: 1e-8, or 1e-4 when AdamW steps fp16 parameters itself.

    In fp16 (no fp32 masters) the second moment of small gradients underflows to zero
    while the first moment does not, so the update is m / eps; 1e-8 (itself below fp16's
    smallest subnormal) lets it explode, 1e-4 bounds it. bf16 has fp32's range: 1e-8.
    """
    return 1e-4 if policy.param_dtype == _F16 and not policy.master_weights else 1e-8


def adamw_factory(policy: Policy, lr: float) -> OptimizerFactory:
    """The optimizer every run uses: AdamW with ``lr`` and the policy's ``adam_eps``."""
    return lambda params: torch.optim.AdamW(params, lr=lr, eps=adam_eps(policy))


def train_step(model: nn.Module, inputs: Any, targets: Any,
               loss_fn: Callable[[Any, Any], Tensor], optimizer: torch.optim.Optimizer,
               precision: Precision) -> Tensor:
    """One optimisation step under a precision; returns the loss, still on the device.

    ``inputs``: a tensor, or any batch ``call_model`` takes (a tuple, a dict)."""
    with precision.autocast:
        loss = loss_fn(call_model(model, inputs), targets)
    scaler = precision.scaler
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # a no-op step when the gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
