"""Perplexity of a scoring function on fixed token windows: the number every compression
and KV-cache change reports.

A scoring function maps `tokens: i32[B, T]` to `logits: [B, T, V]` (any array type that
`np.asarray` converts: jax, numpy, torch on the CPU). Position `t` predicts token `t + 1`,
so a window of T tokens scores its last T - 1 tokens, each conditioned on all tokens
before it in the same window; the first token of a window is never scored.

Numerics: the logits come back to the host and the log-softmax is computed in float64
there (max-shifted logsumexp over V), a block of positions at a time to bound memory.
Per-window sums are float64 and the total is an exactly rounded `math.fsum`, so the
result does not depend on the batch size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np

from jaxdec import corpora
from jaxdec.errors import JaxdecError

ScoreFn = Callable[[np.ndarray], object]  # i32[B, T] -> logits [B, T, V]
_ROWS = 64  # positions converted to float64 at a time: 64 * V * 8 bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerplexityResult:
    """`ppl = exp(nll)`, where `nll` is the mean negative log-likelihood in nats per
    scored token over `n_tokens = n_windows * (T - 1)` tokens. `source` says which text
    and windows were scored (empty when the caller passed windows directly)."""

    ppl: float
    nll: float
    n_tokens: int
    n_windows: int
    source: str = ""

    def __str__(self) -> str:
        where = f" of {self.source}" if self.source else ""
        return (f"ppl {self.ppl:.4f} (nll {self.nll:.6f} nats/token, "
                f"{self.n_tokens:,} tokens in {self.n_windows} windows{where})")


def window_nll(logits: np.ndarray, tokens: np.ndarray) -> float:
    """float64 sum over t < T-1 of `-log softmax(logits[t])[tokens[t + 1]]`.

    logits: [T, V] in any float dtype; tokens: i32[T].
    """
    targets = np.asarray(tokens[1:], dtype=np.int64)  # i64[T-1]
    n = targets.shape[0]
    return math.fsum(_block_nll(logits[s:min(s + _ROWS, n)], targets[s:s + _ROWS])
                     for s in range(0, n, _ROWS))


def _block_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """float64 sum of -log softmax(logits[r])[targets[r]]; logits [R, V], targets i64[R]."""
    x = np.asarray(logits, dtype=np.float64)  # f64[R, V]
    m = x.max(axis=-1, keepdims=True)  # f64[R, 1]
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1))  # f64[R]
    picked = x[np.arange(x.shape[0]), targets]  # f64[R]
    return float(np.sum(lse - picked))


def _batches(tokens: np.ndarray, batch_size: int) -> Iterator[tuple[np.ndarray, int]]:
    """(batch i32[batch_size, T], n_real): the last batch is padded by repeating its last
    row, so a jitted score_fn sees one shape; padded rows are not scored."""
    for start in range(0, tokens.shape[0], batch_size):
        batch = tokens[start:start + batch_size]
        n_real = batch.shape[0]
        pad = np.repeat(batch[-1:], batch_size - n_real, axis=0)
        yield np.concatenate([batch, pad], axis=0), n_real


def _window_nlls(score_fn: ScoreFn, tokens: np.ndarray, batch_size: int) -> Iterator[float]:
    for batch, n_real in _batches(tokens, batch_size):
        logits = np.asarray(score_fn(batch))
        if logits.ndim != 3 or logits.shape[:2] != batch.shape:
            raise ValueError(f"score_fn returned logits of shape {logits.shape} for tokens "
                             f"of shape {batch.shape}; expected [B, T, V]")
        yield from (window_nll(logits[b], batch[b]) for b in range(n_real))


def perplexity(score_fn: ScoreFn, windows, *, batch_size: int = 4) -> PerplexityResult:
    """Perplexity of `score_fn` on `windows` (`corpora.Windows` or i32[n_windows, T]),
    scored `batch_size` windows per call."""
    tokens = np.asarray(windows, dtype=np.int32)  # i32[n_windows, T]
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] < 2:
        raise ValueError(f"need windows of shape [n >= 1, T >= 2], got {tokens.shape}")
    total = math.fsum(_window_nlls(score_fn, tokens, batch_size))
    n_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
    nll = total / n_tokens
    return PerplexityResult(ppl=math.exp(nll), nll=nll, n_tokens=n_tokens,
                            n_windows=tokens.shape[0])


def evaluate(score_fn: ScoreFn, tokenizer_encode: Callable[[str], list[int]], corpus: str,
             *, window: int = 512, max_windows: int | None = None, split: str = "eval",
             batch_size: int = 4) -> PerplexityResult:
    """Perplexity of `score_fn` on the `split` windows of corpus `corpus`.

    `tokenizer_encode(text) -> list[int]` must add no BOS or other special tokens, and
    the harness adds none: every window is plain text ids. The corpus is encoded in
    chunks of whole documents (`corpora.corpus_token_ids`), so windows run over the
    concatenated per-chunk ids and may span documents.
    """
    ids = corpora.corpus_token_ids(corpus, tokenizer_encode)
    windows = corpora.make_windows(ids, window=window, split=split, max_windows=max_windows)
    if len(windows) == 0:
        raise JaxdecError(f"corpus {corpus!r} has no {split} windows of {window} "
                                  f"tokens ({ids.shape[0]:,} tokens)")
    result = perplexity(score_fn, windows, batch_size=batch_size)
    source = (f"{corpus} [{corpora.corpus_source(corpus)}; {ids.shape[0]:,} tokens], "
              f"{split} split, window {window}")
    return dataclasses.replace(result, source=source)
