"""Whether a checkpoint folder is whole: ``save_state`` writes a record of every file it wrote,
last, and ``load_state`` reads nothing from a folder of nblaunch's without one, or with a file
missing or cut short (the kernel died mid-save, a copy stopped half-way).

The record, ``nblaunch_complete.json``: the number of processes that saved it and each file's
size, by its path inside the folder (sharded layouts' subfolders included). A save begins by
writing it as ``{"unfinished": true}``, so a save cut short at any point is refused. A folder Accelerate
wrote has none and no nblaunch data positions either: it is loaded as Accelerate would.

Example::

    mark_complete("ckpt", num_processes=2)      # the main process, after every rank wrote
    check_complete("ckpt")                      # IncompleteCheckpointError if a file is gone
"""

from __future__ import annotations

import json
import os


__all__ = ["RECORD_NAME", "IncompleteCheckpointError", "mark_complete", "mark_unfinished", "check_complete", "saved_by"]

RECORD_NAME = "nblaunch_complete.json"


class IncompleteCheckpointError(ValueError):
    """A checkpoint folder that is not whole: nothing was loaded from it."""


def _files(folder: str) -> dict[str, int]:
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, folder)
            if not relative.startswith(RECORD_NAME):
                found[relative] = os.path.getsize(path)
    return found


def mark_unfinished(folder: str) -> None:
    """Before a save writes into ``folder``: a record saying it is not whole, so a save cut short
    before any file of nblaunch's own was written is never taken for a folder Accelerate wrote."""
    _write(folder, {"unfinished": True})


def mark_complete(folder: str, num_processes: int) -> None:
    """Record every file of ``folder`` (call it once every rank has written its part)."""
    _write(folder, {"num_processes": num_processes, "files": _files(folder)})


def _write(folder: str, record: dict) -> None:
    temporary = os.path.join(folder, f"{RECORD_NAME}.{os.getpid()}.tmp")  # nodes sharing a disk each write one
    with open(temporary, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(temporary, os.path.join(folder, RECORD_NAME))  # whole or absent, never half


def saved_by(folder: str) -> int | None:
    """How many processes saved ``folder`` (None: no record)."""
    try:
        with open(os.path.join(folder, RECORD_NAME)) as f:
            return int(json.load(f)["num_processes"])
    except (OSError, ValueError, KeyError):
        return None


def check_complete(folder: str) -> None:
    """Raise ``IncompleteCheckpointError`` saying what is missing when ``folder`` is one of
    nblaunch's and not whole; a folder Accelerate wrote (no record, no nblaunch positions) passes."""
    record_path = os.path.join(folder, RECORD_NAME)
    unfinished = IncompleteCheckpointError(
        f"checkpoint {folder} is incomplete: its save did not finish (the process stopped while saving; "
        f"save_state writes the list of its files, {RECORD_NAME}, last). Nothing was loaded from it: load an "
        "earlier checkpoint (resume=PATH, or accelerator.load_state(PATH))")
    if not os.path.exists(record_path):
        if any(n.startswith("nblaunch_positions_") for n in os.listdir(folder)):  # layout.positions_name
            raise unfinished  # one of ours whose record was lost
        return
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError) as error:
        raise IncompleteCheckpointError(f"checkpoint {folder}: its {RECORD_NAME} cannot be read ({error})") from None
    if record.get("unfinished"):
        raise unfinished
    recorded = record.get("files", {})
    present = _files(folder)
    missing = sorted(name for name in recorded if name not in present)
    short = sorted(name for name, size in recorded.items() if name in present and present[name] != size)
    if missing or short:
        what = "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                       f"not the size it was saved with: {', '.join(short)}" if short else ""]))
        raise IncompleteCheckpointError(
            f"checkpoint {folder} is incomplete ({what}). Nothing was loaded from it: put the files back, or load an "
            "earlier checkpoint (resume=PATH, or accelerator.load_state(PATH))")
