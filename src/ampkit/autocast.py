"""``ampkit.autocast``: torch.autocast with inferred device and dtype, plus user overrides.

Every op runs through torch's own C++ autocast dispatch, so ops nobody registered cost
exactly what they cost under ``torch.autocast`` (no Python in the per-op path). ampkit
adds only a per-thread frame on enter/exit, which registered overrides consult.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from . import _state, overrides
from ._dtypes import HALF_DTYPES, autocast_default_dtype, check_device_type, resolve_dtype

F = TypeVar("F", bound=Callable[..., Any])
_AUTOCAST_DTYPES = HALF_DTYPES + (torch.float32,)


class autocast:  # noqa: N801 - the name mirrors torch.autocast
    """Context manager and decorator: ops run in the precision torch.autocast picks.

    Args:
        device_type: "cpu", "cuda", ...; None: the device of the model given to the
            active ``initialize``, else "cuda" when available, else "cpu".
        dtype: torch.float16 / torch.bfloat16 or a name ("fp16", "bf16", ...); None: the
            active ``initialize``'s half dtype, else torch's default for the device.
        enabled: False makes the region a no-op (ops keep their dtypes).
        cache_enabled: as torch.autocast (None: torch's default).

    Example:
        >>> with autocast("cpu", dtype="bf16"):
        ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.bfloat16
    """

    def __init__(self, device_type: Optional[str] = None,
                 dtype: Optional[Union[torch.dtype, str]] = None, enabled: bool = True,
                 cache_enabled: Optional[bool] = None) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}")
        self.device_type = (_state.inferred_device_type() if device_type is None
                            else check_device_type(device_type))
        self.fast_dtype = self._resolve_dtype(dtype)
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self._torch = torch.autocast(self.device_type, dtype=self.fast_dtype,
                                     enabled=enabled, cache_enabled=cache_enabled)

    def _resolve_dtype(self, dtype: Optional[Union[torch.dtype, str]]) -> torch.dtype:
        if dtype is not None:
            return resolve_dtype(dtype, allowed=_AUTOCAST_DTYPES, what="autocast dtype")
        active = _state.get_active()
        if active is not None and active.device_type == self.device_type and active.half_dtype:
            return active.half_dtype
        return autocast_default_dtype(self.device_type)

    def __enter__(self) -> "autocast":
        self._torch.__enter__()
        # torch may have disabled itself (e.g. cuda without a GPU): follow what it did.
        overrides.push_frame(self.device_type, self.fast_dtype, self._torch._enabled)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Optional[bool]:
        try:
            overrides.pop_frame()
        finally:
            result = self._torch.__exit__(exc_type, exc, tb)
        return result

    def __call__(self, func: F) -> F:
        args = (self.device_type, self.fast_dtype, self.enabled, self.cache_enabled)

        @functools.wraps(func)
        def decorated(*a: Any, **kw: Any) -> Any:
            # A fresh region per call, so recursive and concurrent calls nest correctly.
            with autocast(*args):
                return func(*a, **kw)

        return decorated  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"ampkit.autocast(device_type={self.device_type!r}, dtype={self.fast_dtype}, "
                f"enabled={self.enabled})")
