"""Token-id rows as batches: padding ragged rows and refusing ids or lengths a model
cannot take. Shared by generation (`jaxdec.api`), speculation and training data, below
all of them."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxdec.config import ModelConfig
from jaxdec.errors import JaxdecError


def pad_rows(rows: Sequence[Sequence[int]], multiple: int = 1, *,
             width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(i32[B, W] token rows right-padded with 0s, i32[B] their lengths): W is `width`, or
    the longest row rounded up to a `multiple` (so few widths compile)."""
    lens = np.array([len(r) for r in rows], np.int32)
    if width is None:
        width = max(1, int(-(-lens.max() // multiple) * multiple))
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, lens


def bucket(n: int, least: int = 1, most: int | None = None) -> int:
    """The compiled size for n (jaxdec.generate's and the engine's, so the two never drift):
    a power of two, at least `least`, up to 512, then a multiple of 512; at most `most`."""
    if n > 512:
        size = -(-n // 512) * 512
    else:
        size = least
        while size < n:
            size *= 2
    return size if most is None else min(size, most)


def bucket_sizes(least: int, most: int) -> list[int]:
    """Every size `bucket(n, least, most)` gives for n in [1, most], ascending."""
    sizes = [bucket(1, least, most)]
    while sizes[-1] < most:
        sizes.append(bucket(sizes[-1] + 1, least, most))
    return sizes


def as_rows(token_ids) -> list[list[int]]:
    """A row, a batch of rows or an integer array [T] / [B, T] -> a list of int rows."""
    if hasattr(token_ids, "__array__") and not isinstance(token_ids, (list, tuple)):
        arr = np.asarray(token_ids)
        return [list(map(int, r)) for r in (arr[None] if arr.ndim == 1 else arr)]
    rows = list(token_ids)
    if rows and isinstance(rows[0], (int, np.integer)):
        rows = [rows]
    return [list(map(int, r)) for r in rows]


def check_ids(rows, vocab: int) -> None:
    """Refuse a token id outside [0, vocab) in one line."""
    for r in rows:
        if r and (min(r) < 0 or max(r) >= vocab):
            raise JaxdecError(f"token id out of range [0, {vocab}) in input")


def check_context(cfg: ModelConfig, prompt_len: int, max_new: int) -> None:
    """Refuse a prompt plus new tokens longer than the model's context in one line."""
    if prompt_len + max_new > cfg.max_position:
        raise JaxdecError(f"prompt of {prompt_len} tokens + {max_new} new tokens exceeds the "
                          f"model's context of {cfg.max_position} tokens")
