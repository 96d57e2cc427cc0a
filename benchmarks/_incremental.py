"""Results that survive a failing case, a timeout or an interrupt (the benchmarks' helper).

A benchmark keeps one JSON document and rewrites it after every completed row with
``write_json`` (a temp file, then ``os.replace``: a reader or a kill mid-write never sees
half a file); a case that raises becomes an error row (``error_fields``) instead of
ending the run; ``interrupted`` turns SIGINT/SIGTERM (``timeout -s INT`` in
benchmarks/gpu_session.sh) into a last write of what was measured, a note in the log and
exit status 130, rather than a traceback and a lost file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import traceback
from typing import Any, Callable, Iterator, Optional


def json_safe(value: Any) -> Any:
    """NaN and infinities as strings (JSON has none); dicts, lists and tuples walked."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Optional[str], document: Any, indent: int = 2) -> None:
    """Write ``document`` to ``path`` atomically (nothing when ``path`` is None or "")."""
    if not path:
        return
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(json_safe(document), f, indent=indent)
    os.replace(tmp, path)


def error_fields(err: BaseException, limit: int = 6) -> dict[str, str]:
    """An error row's fields: ``error`` ("Type: message", one line) and ``traceback``."""
    message = " ".join(str(err).split())[:500]
    return {"error": f"{type(err).__name__}: {message}",
            "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__,
                                                            limit=-limit))}


def free_cuda() -> None:
    """Release a failed case's memory before the next one (gc, then the CUDA cache)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def interrupted(save: Callable[[], None], name: str) -> Iterator[None]:
    """Run the body; on SIGINT (KeyboardInterrupt) or SIGTERM, ``save()`` what there is,
    say so on stderr and exit 130 (SIGTERM is turned into KeyboardInterrupt here)."""
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except KeyboardInterrupt as err:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the save
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        save()
        print(f"\n{name}: INTERRUPTED ({str(err) or 'SIGINT'}): results up to the last completed "
              "row were written", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)  # no interpreter teardown (CUDA, compile workers): exit now
    finally:
        signal.signal(signal.SIGTERM, previous)
