"""The checkpoint folder of ``ampkit train --nproc``: DCP's files and ampkit's run record.

The record (``ampkit-train.json``) holds the run's settings, nproc, threads and history,
the sha256 digest of every file DCP wrote and its own digest: DCP checks no sums, and a
resume refuses a folder whose record or files are not exactly those written. A save goes
to ``DIR.tmp`` and replaces ``DIR`` only once complete (:func:`replace_folder`); a folder
that is not an ampkit checkpoint is never replaced or removed (:func:`check_checkpoint_dir`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from typing import Any

from .errors import UsageError
from .paths import check_can_create

__all__ = ["META", "check_checkpoint_dir", "digests", "read_meta", "record_digest",
           "remove_checkpoint", "replace_folder", "write_record"]

META = "ampkit-train.json"  # the run's settings, nproc, threads, history and files' digests
# Format 2 records the sha256 digest of every file DCP wrote; 1 (no digests) is refused.
_FORMAT, _UNSEALED_FORMAT = "ampkit-train-dcp-2", "ampkit-train-dcp-1"


def check_checkpoint_dir(path: str, resume: bool) -> None:
    """UsageError unless ``path`` can hold a DCP checkpoint (and holds one to resume)."""
    if os.path.isfile(path):
        raise UsageError(f"--checkpoint {path!r} is a file; with --nproc a checkpoint is a "
                         "folder (torch.distributed.checkpoint); valid: a folder path")
    if resume:
        read_meta(path, verify=False)  # the files' digests: once, in check_parallel_train
        return
    for where in (path, path + ".tmp", path + ".old"):  # the run replaces or removes these
        if os.path.islink(where):
            raise UsageError(f"--checkpoint {path!r}: {where!r} is a link, and the run would "
                             "replace or remove it; valid: a real folder path")
        # PATH.tmp is ampkit's scratch: a save killed before its record leaves DCP files
        # there without one. PATH.old always has its record (remove_checkpoint takes it
        # last), so DCP files there without one are another program's.
        foreign = _foreign_entries(where, record=not where.endswith(".tmp"))
        if foreign:
            raise UsageError(
                f"--checkpoint {path!r}: {where!r} holds {foreign[0]!r}, which is not part of "
                "a checkpoint of ampkit train --nproc, and the run would "
                f"{'replace' if where == path else 'remove'} that folder; "
                "valid: a new or empty folder, or the folder of an earlier ampkit train "
                "--nproc run")
    try:
        check_can_create(path)
    except OSError as err:
        raise UsageError(f"--checkpoint {path!r} cannot be written ({err.strerror or err}); "
                         "valid: a folder path in a folder you can write to") from None


def _foreign_entries(folder: str, record: bool) -> list[str]:
    """What ``folder`` holds besides a DCP checkpoint's files and ampkit's record (a file
    in its place counts as foreign too), sorted; [] when it does not exist or is empty.
    ``record``: DCP files without ampkit's record are foreign too (another program's
    checkpoint; only a save killed before its record, at PATH.tmp, leaves them so)."""
    if not os.path.lexists(folder):
        return []
    if not os.path.isdir(folder):
        return [os.path.basename(folder)]
    names = os.listdir(folder)
    foreign = sorted(name for name in names if not (
        name == META or name.startswith(".metadata") or name.endswith(".distcp")))
    if not foreign and record and names and META not in names:
        return sorted(names)
    return foreign


def read_meta(path: str, *, verify: bool = True) -> dict[str, Any]:
    """The run record of a DCP checkpoint that ``train --nproc`` wrote; ``verify``: also
    check the sha256 digests of the record and of every file (reading all of them)."""
    _finish_replace(path)
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise UsageError(f"--resume: no ampkit train --nproc checkpoint at {path!r} (no {META}); "
                         "valid: the --checkpoint folder of an earlier run with --nproc")
    try:
        with open(meta_path) as src:
            meta = json.load(src)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"--resume: {meta_path!r} cannot be read ({type(err).__name__}: "
                         f"{err}), the checkpoint is damaged; valid: an intact copy, or start "
                         "again without --resume") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found == _UNSEALED_FORMAT:
        raise UsageError(f"--resume: checkpoint {path!r} has no sha256 digests (format "
                         f"{found!r}, written by an earlier ampkit), so its content cannot be "
                         f"verified; valid: a checkpoint in format {_FORMAT!r} (start again "
                         "without --resume, or finish that run with the ampkit that wrote it)")
    if found != _FORMAT:
        raise UsageError(f"--resume: {meta_path!r} is not in format {_FORMAT!r}; valid: a "
                         "checkpoint that ampkit train --nproc wrote")
    if verify:
        _check_digests(path, meta)
    return meta


def digests(folder: str) -> dict[str, str]:
    """The sha256 digest of every file under ``folder`` but the run record, by relative path."""
    digests = {}
    for root, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, folder)
            if relative == META:
                continue
            digest = hashlib.sha256()
            with open(full, "rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
            digests[relative] = digest.hexdigest()
    return dict(sorted(digests.items()))


def record_digest(meta: dict[str, Any]) -> str:
    """The sha256 digest of the run record itself (its settings, history and file digests)."""
    record = {key: value for key, value in meta.items() if key != "record_sha256"}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _check_digests(path: str, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint whose record or files are not exactly those written (DCP checks
    no sums)."""
    expected = meta.get("sha256")
    if not isinstance(expected, dict):
        why = "its record holds no digests"
    elif meta.get("record_sha256") != record_digest(meta):
        why = f"{META!r} does not match the sha256 digest recorded in it"
    else:
        found = digests(path)
        if found == expected:
            return
        name = next(n for n in sorted(set(found) | set(expected))
                    if found.get(n) != expected.get(n))
        why = (f"{name!r} is missing" if name not in found else
               f"{name!r} was not written with it" if name not in expected else
               f"{name!r} does not match the sha256 digest recorded when it was written")
    raise UsageError(f"--resume: checkpoint {path!r} is corrupted: {why}; valid: an intact "
                     "copy, or start again without --resume")


def write_record(folder: str, fields: dict[str, Any]) -> None:
    """Write the run record into ``folder``, once DCP wrote every file: ``fields`` with the
    format, the files' digests and the record's own."""
    meta = dict({"format": _FORMAT}, **fields, sha256=digests(folder))
    meta["record_sha256"] = record_digest(meta)
    with open(os.path.join(folder, META), "w") as out:
        json.dump(meta, out)


def replace_folder(tmp: str, path: str) -> None:
    """Put the folder ``tmp`` at ``path``; the previous checkpoint goes only once it is there."""
    old = path + ".old"
    remove_checkpoint(old)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    remove_checkpoint(old)


def remove_checkpoint(folder: str) -> None:
    """Remove a checkpoint folder, its run record last: one that a kill interrupted still
    has its record, so the next run knows it for ampkit's (and removes it)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name != META:
            entry = os.path.join(folder, name)
            if os.path.isdir(entry) and not os.path.islink(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(entry)
    shutil.rmtree(folder, ignore_errors=True)


def _finish_replace(path: str) -> None:
    # A save killed between _replace's two renames left the previous checkpoint at .old.
    if not os.path.exists(path) and os.path.isdir(path + ".old"):
        os.replace(path + ".old", path)
