"""The ``ampkit train`` checkpoint file: written atomically, sealed with a sha256 digest.

torch.load verifies no checksum, so flipped bits in tensor data would load silently: the
file holds ``{"format", "sha256", "payload"}``, the payload being the ``torch.save`` bytes
of the trainer's state, and a resume checks the digest before anything is read from it.
Only tensors and plain values are read back (``weights_only``): no code runs on load.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import re
from typing import Any, Union

import torch

from .errors import UsageError

# Format 2: the file holds {"format", "sha256", "payload"}, the payload being the
# torch.save bytes of the state; format 1 (no digest) is refused.
FORMAT, _UNSEALED_FORMAT = "ampkit-train-2", "ampkit-train-1"


def save_checkpoint(state: dict[str, Any], path: str) -> None:
    """Write ``state`` atomically (a crash mid-write leaves the previous file), sealed
    with its digest; :func:`load_checkpoint` reads it back."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _remove_stale_temp_files(path)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(_seal(state), tmp)
    os.replace(tmp, path)


def _seal(state: dict[str, Any]) -> dict[str, Any]:
    """The file's record: ``state`` serialized, with the sha256 digest of those bytes.

    torch.load checks no CRC, so flipped bits in tensor data would load silently.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    return {"format": FORMAT, "sha256": hashlib.sha256(payload).hexdigest(),
            "payload": torch.frombuffer(payload, dtype=torch.uint8)}


def _unseal(record: Any, path: str) -> Any:
    """The payload of a record that ``_seal`` wrote, once its digest matches."""
    found = record.get("format") if isinstance(record, dict) else type(record).__name__
    if found == _UNSEALED_FORMAT:
        raise UsageError(f"--resume: checkpoint {path!r} has no sha256 digest (format "
                         f"{found!r}, written by an earlier ampkit), so its content cannot be "
                         f"verified; valid: a checkpoint in format {FORMAT!r} (start again "
                         "without --resume, or finish that run with the ampkit that wrote it)")
    if found != FORMAT:
        raise UsageError(f"--resume: {path!r} is not an ampkit train checkpoint (format "
                         f"{found!r}); valid: a file that ampkit train --checkpoint wrote")
    payload = record.get("payload")
    ok = (torch.is_tensor(payload) and payload.dtype == torch.uint8 and payload.dim() == 1
          and payload.is_contiguous())  # a flipped bit in its header can make it strided
    if not ok or hashlib.sha256(payload.numpy()).hexdigest() != record.get("sha256"):
        raise UsageError(f"--resume: checkpoint {path!r} is corrupted: its content does not "
                         "match the sha256 digest stored with it; valid: an intact copy, or "
                         "start again without --resume")
    return _read(io.BytesIO(payload.numpy()), path)


def check_replaceable(path: str) -> None:
    """UsageError unless a run may write its checkpoint at ``path``: nothing there, an
    empty file, or a checkpoint that ampkit train wrote (the run replaces it). Anything
    else is the user's and is left alone. Reads only the record's pickle (mmap), so even
    a large file is told quickly."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    ours = False
    for mmap in (True, False):  # (a file system without mmap: read it whole)
        try:
            record = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception:  # noqa: BLE001 - not a torch.save archive, or not of ours
            continue
        ours = isinstance(record, dict) and record.get("format") in (FORMAT, _UNSEALED_FORMAT)
        break
    if not ours:
        raise UsageError(f"--checkpoint {path!r} exists and is not a checkpoint of ampkit "
                         "train, and the run would overwrite it; valid: a new path, or the "
                         "checkpoint of an earlier ampkit train run (it is replaced)")


def _remove_stale_temp_files(path: str) -> None:
    """Remove the ``PATH.tmp<pid>`` files of saves that were killed mid-write.

    Only that checkpoint's own temp files, and only when process ``pid`` is gone (a
    POSIX check; elsewhere none are removed): a live writer keeps its file.
    """
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(name) + r"\.tmp(\d+)")
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        match = pattern.fullmatch(entry)
        if match and not _process_exists(int(match.group(1))):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, entry))


def _process_exists(pid: int) -> bool:
    if os.name != "posix":
        return True  # no cheap, safe check (os.kill(pid, 0) signals on Windows)
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # PermissionError: it exists, under another user
        pass
    return True


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read a checkpoint (tensors and plain values only: no code runs on load)."""
    _remove_stale_temp_files(path)
    if not os.path.isfile(path):
        raise UsageError(f"--resume: no checkpoint at {path!r}; valid: the --checkpoint path "
                         "of an earlier run")
    return _unseal(_read(path, path), path)


def _read(source: Union[str, io.BytesIO], path: str) -> Any:
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's message suggests weights_only=False (code would run on load): not here.
        raise UsageError(f"--resume: {path!r} is not a checkpoint ampkit train wrote (it is no "
                         "torch file of tensors and plain values only); valid: the --checkpoint "
                         "file of an earlier run") from None
    except Exception as err:  # a truncated or foreign file can fail in many ways
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        why = ("the file is empty" if isinstance(source, str) and os.path.getsize(source) == 0
               else f"not a whole torch file: truncated or damaged; {type(err).__name__}: "
                    f"{first or 'it ends early'}")
        raise UsageError(f"--resume: cannot read checkpoint {path!r} ({why}); valid: the "
                         "--checkpoint file of an earlier run, whole") from None
