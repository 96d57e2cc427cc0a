"""Float8Linear: an nn.Linear whose three matmuls run in fp8 with fp32 accumulation.

Forward ``out = x @ W^T``, grad-input ``gx = g @ W`` and grad-weight ``gW = g^T @ x``
all go through one helper, :func:`fp8_mm`, which either calls ``torch._scaled_mm``
(fp8 tensor cores) or emulates it: the fp8 operands are widened to fp32, multiplied
in fp32 and the product is scaled, which is the tensor cores' arithmetic (fp8
products are exact in fp32) up to summation order. Every numerics test therefore runs
on CPU.

The high-precision weight stays the nn.Parameter; fp8 copies live only inside a step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

from .._dtypes import autocast_output_dtype, capability, fp8_supported, to_dtype
from .._torch_compat import AfterApply, graph_break, is_compiling, scaled_mm, unsafe_view
from .._warn import warn_once
from .allgather import Fp8GatheredWeight
from .checkpointed import checkpointed_scales
from .config import Float8Config, Recipe
from .histories import HISTORIES_IN_COMPILE, ROLE_NAMES, DelayedHistories
from .scaling import (E4M3, E5M2, Fp8, amax_to_scale, history_amax, quantize, quantize_delayed,
                      refuse_transforms)

_INPUT, _WEIGHT, _GRAD = 0, 1, 2


def check_fp8_dims(in_features: int, out_features: int) -> Optional[str]:
    """Why a linear layer cannot run in fp8 (None when it can).

    fp8 GEMMs need every dimension that is a GEMM's K or N (in the forward and both
    backward matmuls: in_features and out_features) to be a multiple of 16, and a layer
    without features has no GEMM to run (nn.Linear gives its empty or bias-only output).
    """
    if in_features % 16 or out_features % 16 or not (in_features and out_features):
        return (f"in_features={in_features} and out_features={out_features} must both "
                f"be positive multiples of 16 for fp8 GEMMs")
    return None


def check_fp8_backend(config: Float8Config, device: torch.device) -> None:
    """Raise RuntimeError when ``config`` demands fp8 tensor cores (emulate=False) that
    ``device`` lacks."""
    if config.emulate is not False or fp8_supported(str(device)):
        return
    raise RuntimeError(f"Float8Config(emulate=False) needs fp8 tensor cores, but {device} "
                       f"({capability(str(device)).name}) has none; valid: emulate=None or True "
                       "there, or a GPU with fp8 tensor cores (compute capability >= 8.9)")


def fp8_mm(a: Fp8, b: Fp8, out_dtype: torch.dtype, native: bool,
           fast_accum: bool = False) -> Tensor:
    """``a @ b`` of two fp8 tensors, accumulated in fp32 and scaled, as ``out_dtype``.

    Args:
        a: left operand (M, K); scale 0-dim or (M, 1).
        b: right operand (K, N); scale 0-dim or (1, N).
        out_dtype: dtype of the result.
        native: call ``torch._scaled_mm`` (fp8 tensor cores) instead of emulating.
        fast_accum: Hopper's fast fp8 accumulation (native path only).

    Returns:
        The (M, N) product.

    Example:
        >>> q = quantize(torch.eye(16) * 3.5, E4M3)  # scale 128: exact round trip
        >>> fp8_mm(q, q, torch.float32, native=False).equal(torch.eye(16) * 12.25)
        True
    """
    # torch._scaled_mm's per-row kernel only writes bf16, so rowwise GEMMs round to bf16
    # on both paths: the emulation keeps the tensor cores' numerics.
    gemm_dtype = torch.bfloat16 if a.inv_scale.dim() == 2 else out_dtype
    if native:
        out = _scaled_mm(a, b, gemm_dtype, fast_accum)
    else:
        # Scales applied to the fp32 accumulator, as the GEMM epilogue does.
        out = to_dtype(torch.mm(a.data.float(), b.data.float()) * (a.inv_scale * b.inv_scale),
                  gemm_dtype)
    return to_dtype(out, out_dtype)


def _scaled_mm(a: Fp8, b: Fp8, out_dtype: torch.dtype, fast_accum: bool) -> Tensor:
    a_data, b_data = _gemm_layout(a.data, b.data)
    return scaled_mm(a_data, b_data, a.inv_scale, b.inv_scale, out_dtype, fast_accum)


def _gemm_layout(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Operands in the only layout fp8 cuBLASLt GEMMs take: A row-major, B column-major.

    K must also be a multiple of 16; in grad-weight K is the number of rows of the
    batch, so it is zero-padded there (zeros add nothing to the product).

    Layout costs per step (tensorwise): the forward's ``W^T`` is a free view of the
    row-major fp8 weight (already column-major); grad-input needs W itself column-major
    and grad-weight needs ``g^T`` row-major and ``x`` column-major, i.e. one transposed
    copy each of three fp8 tensors (1 byte read + 1 written per element), which is far
    cheaper than casting the high-precision tensors again (an amax pass, then a cast).
    """
    pad = -a.shape[1] % 16
    if pad == 0:
        return a.contiguous(), b.t().contiguous().t()
    a_pad = a.new_zeros(a.shape[0], a.shape[1] + pad)
    a_pad[:, : a.shape[1]] = a
    bt_pad = b.new_zeros(b.shape[1], b.shape[0] + pad)
    bt_pad[:, : b.shape[0]] = b.t()
    return a_pad, bt_pad.t()


class _CastState(NamedTuple):
    """What one step's casts need: the recipe, delayed histories, warm-up flag."""

    config: Float8Config
    histories: tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]
    warmup: bool
    record: bool  # forward amaxes go into the histories (grad mode on: training)
    # Delayed recipe under activation checkpointing: the forward collects the amaxes its
    # input and weight scales came from (``used``); the recomputation casts by those
    # (``fixed``) and records nothing, so it casts exactly as the forward did.
    used: Optional[list[Tensor]] = None
    fixed: Optional[tuple[Tensor, ...]] = None


def _cast(t: Tensor, role: int, dim: int, state: _CastState) -> Fp8:
    """The one fp8 cast of this module: ``t`` as operand ``role`` per the recipe.

    ``dim`` is the contraction dimension; only the rowwise recipe scales along it.
    """
    config = state.config
    if config.recipe is Recipe.ROWWISE:
        return quantize(t, E4M3, dim=dim, margin=config.margin)
    dtype = E5M2 if role == _GRAD else E4M3
    history = state.histories[role]
    if history is None:
        return quantize(t, dtype, margin=config.margin)
    if state.fixed is not None and role != _GRAD:
        return quantize(t, dtype, scale=amax_to_scale(state.fixed[role], dtype, config.margin))
    return quantize_delayed(t, dtype, history, algo=config.amax_compute_algo,
                            margin=config.margin, warmup=state.warmup,
                            record=state.record or role == _GRAD,
                            used=None if role == _GRAD else state.used)


class _Fp8LinearFn(torch.autograd.Function):
    """``x @ W^T`` with fp8 operands in forward and both backward matmuls.

    ``x`` is 2-D; the output comes back with leading dimensions ``lead`` and is not a
    view (as nn.Linear's is not): FSDP2 hooks a module's output for its backward, and an
    in-place op on a view of it would drop that hook.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, lead: tuple[int, ...], config: Float8Config,  # type: ignore[override]
                native: bool, out_dtype: torch.dtype, warmup: bool, record: bool,
                h_in: Optional[Tensor], h_w: Optional[Tensor], h_g: Optional[Tensor],
                used: Optional[list[Tensor]] = None,
                fixed: Optional[tuple[Tensor, ...]] = None) -> Tensor:
        state = _CastState(config, (h_in, h_w, h_g), warmup, record, used, fixed)
        gathered = isinstance(weight, Fp8GatheredWeight)
        if gathered and config.recipe is not Recipe.TENSORWISE:
            raise RuntimeError(f"Float8Linear(recipe={config.short}) got a weight FSDP2 "
                               "gathered in fp8 with one scale (shard's fp8_all_gather, for "
                               "tensorwise layers); valid: keep the recipe the layer was "
                               "sharded with, or shard(..., fp8_all_gather=False)")
        with torch.autocast(x.device.type, enabled=False):  # our fp32 math stays fp32
            x_q = _cast(x, _INPUT, -1, state)
            # FSDP2 gathered the weight in fp8 already (tensorwise, same cast: allgather.py).
            w_q = weight.fp8() if gathered else _cast(weight, _WEIGHT, -1, state)
            out = fp8_mm(x_q, w_q.t(), out_dtype, native, config.output_fast_accum)
        if config.recipe is Recipe.ROWWISE:
            # Backward needs per-column scales of x and W: cast again from high precision.
            ctx.save_for_backward(x, weight)
        else:
            # Per-tensor scales do not depend on the layout: backward reuses these casts.
            ctx.save_for_backward(x_q.data, x_q.inv_scale, w_q.data, w_q.inv_scale)
        ctx.state, ctx.native = state, native
        ctx.dtypes = (x.dtype, weight.dtype)
        return unsafe_view(out, (*lead, out.shape[-1]))

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: a gradient of this gradient is asked
            # The gradients come from detached fp8 copies: a graph of them would silently
            # lack every path through the weight.
            raise RuntimeError("Float8Linear has no double backward (a backward with "
                               "create_graph=True, e.g. a gradient penalty); valid: keep the "
                               "layers that penalty differentiates through out of fp8 "
                               "(convert_to_fp8(..., module_filter=...))")
        state, native = ctx.state, ctx.native
        (x_dtype, w_dtype), (need_x, need_w) = ctx.dtypes, ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        grad_out = grad_out.reshape(-1, grad_out.shape[-1])
        with torch.autocast(grad_out.device.type, enabled=False):
            g_rows = _cast(grad_out, _GRAD, -1, state)
            if state.config.recipe is Recipe.ROWWISE:
                # Each operand scaled along this GEMM's contraction dimension.
                x, weight = ctx.saved_tensors
                if need_x:
                    grad_x = fp8_mm(g_rows, _cast(weight, _WEIGHT, 0, state), x_dtype, native)
                if need_w:
                    g_cols = _cast(grad_out, _GRAD, 0, state)
                    grad_w = fp8_mm(g_cols.t(), _cast(x, _INPUT, 0, state), w_dtype, native)
            else:
                x_data, x_inv, w_data, w_inv = ctx.saved_tensors
                if need_x:
                    grad_x = fp8_mm(g_rows, Fp8(w_data, w_inv), x_dtype, native)
                if need_w:
                    grad_w = fp8_mm(g_rows.t(), Fp8(x_data, x_inv), w_dtype, native)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None, None


def _warn_emulation_once(device: torch.device, recipe: str) -> None:
    if device.type == "meta":
        return
    warn_once(("fp8-linear-emulation", device.type, recipe),
              f"ampkit.fp8: no fp8 tensor cores on {device.type!r}; Float8Linear emulates "
              "fp8 matmuls there (same numerics, no speed-up). Pass "
              f"convert_to_fp8(model, recipe=Float8Config({recipe!r}, emulate=True)) (with "
              "any other settings of yours) to silence this.")


class Float8Linear(DelayedHistories, AfterApply, nn.Linear):
    """An nn.Linear whose forward and backward matmuls run in fp8.

    Args:
        in_features, out_features, bias, device, dtype: as for nn.Linear
            (both feature counts multiples of 16).
        config: a :class:`Float8Config` or a recipe name ("tensorwise", "delayed",
            "rowwise").

    The output is in the autocast dtype inside an autocast region, else in the input's
    dtype; gradients come back in the input's and the weight's dtypes. An inf or NaN in
    an input or gradient makes NaN every value cast with its scale (the whole tensor; its
    row or column under rowwise), never finite but wrong; under the delayed recipe, past
    its first step, the scale comes from the history, so only the products that meet it
    are NaN, and its amax does not enter the history (which still moves one step: the
    newest finite amax is entered again in its place). The delayed
    recipe keeps its amax histories in non-persistent buffers, so ``state_dict`` holds
    exactly nn.Linear's ``weight`` and ``bias``; ``fp8_state_dict`` saves them to resume
    exactly. Its first training forward scales by the tensors' own amax (the histories
    are empty). A cast whose history has recorded nothing finite yet (the gradient's, at
    the first backward after a forward without one or after a step whose gradient held
    an inf) scales by its tensor's own amax too, eagerly; under torch.compile, where the
    cast does not wait for that amax, it is cast with scale 1 that once, as in
    Transformer Engine's first step. No-grad forwards (evaluation) read
    the histories without updating them. A layer built on the meta device gets zero
    histories on its weight's device, as one built there: at ``to_empty()``, or at the
    first forward after ``load_state_dict(..., assign=True)`` (under torch.compile one
    graph break in that call; ``fullgraph=True`` raises, saying so). Under eager
    ``torch.utils.checkpoint`` (non-reentrant; torch 2.11 or newer) each recomputation
    casts by the scales its own forward used and records nothing, so a checkpointed run
    equals an unchecked one bitwise; reentrant checkpointing runs the forward without
    grad and records in the recomputation, which is the same where each layer runs once
    per backward. Not
    covered: checkpointing inside torch.compile, and a selective ``context_fn`` that
    saves the casts' own ops. There is no double backward and no torch.func transform
    (both raise).

    Example:
        >>> layer = Float8Linear(32, 16, config=Float8Config("tensorwise", emulate=True))
        >>> layer(torch.randn(4, 32)).shape
        torch.Size([4, 16])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Optional[Union[str, torch.device]] = None,
                 dtype: Optional[torch.dtype] = None, *,
                 config: Union[Float8Config, Recipe, str] = Recipe.TENSORWISE) -> None:
        config = Float8Config.coerce(config)
        reason = check_fp8_dims(in_features, out_features)
        if reason is not None:
            raise ValueError(f"Float8Linear({in_features}, {out_features}): {reason}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config
        self._reset_fp8_state()

    @classmethod
    def from_linear(cls, linear: nn.Linear,
                    recipe: Union[Float8Config, Recipe, str] = Recipe.TENSORWISE) -> "Float8Linear":
        """A Float8Linear that shares ``linear``'s weight and bias Parameters.

        The Parameters are the same objects, so an optimizer built before the swap keeps
        working and tied weights stay tied. Hooks registered on ``linear`` do not move.

        Example:
            >>> Float8Linear.from_linear(nn.Linear(32, 16), "rowwise").config.recipe.value
            'rowwise'
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Float8Linear.from_linear needs an nn.Linear, got "
                            f"{type(linear).__name__}; valid: torch.nn.Linear and its subclasses")
        config = Float8Config.coerce(recipe)
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device="meta", dtype=linear.weight.dtype, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        new._reset_fp8_state()
        return new

    def _reset_fp8_state(self) -> None:
        """(Re)create the delayed histories on the weight's device; forget the backend."""
        delayed = self.config.recipe is Recipe.DELAYED
        for name in ROLE_NAMES:
            history = self._zero_history() if delayed else None
            self.register_buffer(f"amax_history_{name}", history, persistent=False)
        self._histories_pending = delayed and self.weight.device.type == "meta"  # (histories.py)
        self._delayed_started = False
        self._backend_device: Optional[torch.device] = None
        self._native = False
        self._resolve_backend()

    # .half()/.to(bf16) and initialize's cast leave them fp32 and exact: an amax rounded
    # down in a 16-bit history would make the next scale too large and saturate, and one
    # above 65504 (a gradient under a loss scale) would become inf.
    FP32_BUFFERS = tuple(f"amax_history_{name}" for name in ROLE_NAMES)
    def after_apply(self, *, emptied: bool = False) -> None:
        # After .to()/.cuda()/.half()/.to_empty() (_torch_compat.AfterApply): decide the
        # backend and make meta-built (or emptied) histories for the new device now, in
        # eager code, so a compiled forward only reads Python bools.
        self._histories_moved(emptied)
        self._resolve_backend()

    def _resolve_backend(self) -> bool:
        """Whether this layer calls torch._scaled_mm: decided once per weight device."""
        device = self.weight.device
        if device != self._backend_device:
            self._native = self.config.emulate is not True and fp8_supported(str(device))
            self._backend_device = device
            # Dynamo cannot trace warnings.warn; resolution normally happens in eager
            # code anyway (construction, .to(), the first eager forward).
            if not self._native and self.config.emulate is None and not is_compiling():
                _warn_emulation_once(device, self.config.recipe.value)
        return self._native

    @property
    def native(self) -> bool:
        """Read-only: whether this layer's matmuls run on fp8 tensor cores
        (``torch._scaled_mm``) on its weight's current device, rather than emulated in
        fp32 (``Float8Config.emulate``, and whether the device has fp8 tensor cores).

        Example:
            >>> Float8Linear(32, 16, config=Float8Config("tensorwise", emulate=True)).native
            False
        """
        return self._resolve_backend()

    def _use_scaled_mm(self) -> bool:
        native = self._resolve_backend()
        if not native:
            check_fp8_backend(self.config, self.weight.device)
        return native

    def _warmup_step(self) -> bool:
        # The delayed recipe's first training step scales by the current amax (its
        # histories are still empty); a Python flag, so torch.compile recompiles once
        # instead of branching on a device value.
        if self.config.recipe is not Recipe.DELAYED or self._delayed_started:
            return False
        if torch.is_grad_enabled():
            self._delayed_started = True
        return True

    def _history_scales(self) -> tuple[Tensor, Tensor]:
        """The amaxes the input and weight histories give now."""
        algo = self.config.amax_compute_algo
        return history_amax(self.amax_history_input, algo), history_amax(self.amax_history_weight, algo)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Float8Linear expected inputs with last dimension "
                             f"{self.in_features}, got shape {tuple(x.shape)}")
        refuse_transforms("Float8Linear", "keep this layer out of fp8 "
                          "(convert_to_fp8(..., module_filter=...))")
        if self._histories_pending and self._make_pending_histories() and is_compiling():
            # Dynamo makes the new histories in a graph of their own: made in the graph that
            # updates them in place, AOTAutograd's partitioner fails (torch 2.13).
            graph_break(HISTORIES_IN_COMPILE)
        native = self._use_scaled_mm()
        if x.numel() == 0:  # no amax of an empty batch; nothing to multiply either
            dtype = autocast_output_dtype(x)
            bias = None if self.bias is None else self.bias.to(dtype)
            return nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)
        histories = (self.amax_history_input, self.amax_history_weight,
                     self.amax_history_grad_output)
        used, fixed = (checkpointed_scales(self, self._history_scales)
                       if self.config.recipe is Recipe.DELAYED else (None, None))
        out = _Fp8LinearFn.apply(x.reshape(-1, self.in_features), self.weight, tuple(x.shape[:-1]),
                                 self.config, native, autocast_output_dtype(x), self._warmup_step(),
                                 torch.is_grad_enabled() and fixed is None, *histories, used, fixed)

        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        grad = "e4m3" if self.config.recipe is Recipe.ROWWISE else "e5m2"
        return f"{super().extra_repr()}, recipe={self.config.short}, x/w=e4m3, grad={grad}"
