"""Small file helpers shared by the commands, scripts and training loop."""

from __future__ import annotations

import os
import pathlib


def write_text_atomic(path: str | os.PathLike, text: str) -> pathlib.Path:
    """Write `text` to `path` through a sibling temporary file and an atomic rename, so a
    reader (or a run killed midway) sees the old file or the new one, never half of one.
    Creates the parent directory."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
