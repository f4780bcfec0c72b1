"""Distillation losses from logits, averaged over the masked positions.

    forward_kl(target_logits, draft_logits, mask)   KL(p || q): the draft covers the target
    reverse_kl(target_logits, draft_logits, mask)   KL(q || p): the draft seeks its modes
    cross_entropy(logits, labels, mask)             -log q(label): hard labels

Logits are [..., V] (any float dtype; the math runs in float32 through log_softmax), the
mask is [...] with 1 where a position counts. A mask with no 1s gives 0, not NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """sum(values * mask) / sum(mask), 0 when the mask is empty."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def kl(p_logits: jax.Array, q_logits: jax.Array) -> jax.Array:
    """Per-position KL(p || q) [...] of the distributions softmax(p_logits), softmax(q_logits)."""
    log_p = jax.nn.log_softmax(p_logits.astype(jnp.float32), axis=-1)
    log_q = jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=-1)
    # p * (log p - log q) with p == 0 contributing 0 (a -inf logit is allowed in p)
    terms = jnp.where(log_p > -jnp.inf, jnp.exp(log_p) * (log_p - log_q), 0.0)
    return jnp.sum(terms, axis=-1)


def forward_kl(target_logits: jax.Array, draft_logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over mask of KL(p_target || q_draft)."""
    return masked_mean(kl(target_logits, draft_logits), mask)


def reverse_kl(target_logits: jax.Array, draft_logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over mask of KL(q_draft || p_target)."""
    return masked_mean(kl(draft_logits, target_logits), mask)


def cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over mask of -log softmax(logits)[label]; labels i32[...] (any value where the
    mask is 0: they are clipped into range)."""
    log_q = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    labels = jnp.clip(labels, 0, logits.shape[-1] - 1)
    nll = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
    return masked_mean(nll, mask)


def top1_agreement(target_logits: jax.Array, draft_logits: jax.Array,
                   mask: jax.Array) -> jax.Array:
    """Fraction of masked positions where both argmaxes agree: greedy acceptance per token."""
    same = jnp.argmax(target_logits, -1) == jnp.argmax(draft_logits, -1)
    return masked_mean(same.astype(jnp.float32), mask)
