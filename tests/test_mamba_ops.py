"""Mamba2 building blocks (jaxdec.models.mamba) against float64 NumPy references written from
the recurrence: chunked SSD == sequential scan == step-by-step decode, the conv-state cache,
the gated RMSNorm."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdec.config import MambaConfig
from jaxdec.models import mamba


def make(b, t, nh, hd, ng, ds, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, t, nh, hd)).astype(np.float32)
    dt = np.log1p(np.exp(rng.standard_normal((b, t, nh)))).astype(np.float32)  # softplus > 0
    A = -np.exp(rng.standard_normal(nh)).astype(np.float32)
    B = rng.standard_normal((b, t, ng, ds)).astype(np.float32)
    C = rng.standard_normal((b, t, ng, ds)).astype(np.float32)
    D = rng.standard_normal(nh).astype(np.float32)
    s0 = rng.standard_normal((b, nh, hd, ds)).astype(np.float32)
    return x, dt, A, B, C, D, s0


def sequential(x, dt, A, B, C, D, s0):
    """float64 reference: the recurrence one token at a time."""
    x, dt, A, B, C, D, s = (np.asarray(a, np.float64) for a in (x, dt, A, B, C, D, s0))
    b, t, nh, hd = x.shape
    rep = nh // B.shape[2]
    y = np.zeros_like(x)
    for i in range(t):
        for h in range(nh):
            g = h // rep
            s[:, h] = (np.exp(dt[:, i, h] * A[h])[:, None, None] * s[:, h]
                       + (dt[:, i, h, None] * x[:, i, h])[:, :, None] * B[:, i, g, None, :])
            y[:, i, h] = np.einsum("bpn,bn->bp", s[:, h], C[:, i, g]) + D[h] * x[:, i, h]
    return y, s


@pytest.mark.parametrize("t,chunk", [(37, 8), (64, 16), (5, 16), (1, 4)])
@pytest.mark.parametrize("nh,ng", [(4, 1), (6, 2), (3, 3)])
def test_chunked_scan_matches_sequential(t, chunk, nh, ng):
    x, dt, A, B, C, D, s0 = make(2, t, nh, 8, ng, 5, seed=t + nh + ng)
    y, s = jax.jit(mamba.ssd_chunked, static_argnames="chunk")(x, dt, A, B, C, D, chunk=chunk,
                                                               state=s0)
    y_ref, s_ref = sequential(x, dt, A, B, C, D, s0)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=2e-4, atol=2e-4)


def test_steps_continue_a_chunked_prefill():
    """Prefill a prompt chunked, then decode token by token: equals the whole sequence."""
    x, dt, A, B, C, D, s0 = make(3, 20, 4, 8, 2, 6, seed=1)
    y_all, s_all = sequential(x, dt, A, B, C, D, s0)
    y, s = mamba.ssd_chunked(x[:, :13], dt[:, :13], A, B[:, :13], C[:, :13], D, chunk=4, state=s0)
    outs = [np.asarray(y)]
    step = jax.jit(mamba.ssd_step)
    for i in range(13, 20):
        yi, s = step(s, x[:, i], dt[:, i], A, B[:, i], C[:, i], D)
        outs.append(np.asarray(yi)[:, None])
    np.testing.assert_allclose(np.concatenate(outs, axis=1), y_all, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(s), s_all, rtol=2e-4, atol=2e-4)


def test_dt_zero_leaves_the_state():
    """Padding and finished rows pass dt = 0: their state does not move."""
    x, dt, A, B, C, D, s0 = make(2, 6, 4, 8, 1, 5, seed=2)
    dt[1, 3:] = 0.0
    _, s_part = sequential(x[:, :3], dt[:, :3], A, B[:, :3], C[:, :3], D, s0)
    _, s = mamba.ssd_chunked(x, dt, A, B, C, D, chunk=4, state=s0)
    np.testing.assert_allclose(np.asarray(s)[1], s_part[1], rtol=2e-4, atol=2e-4)


def conv_reference(x, w, bias, state, lengths):
    """float64: torch Conv1d(groups=C, padding=K-1) semantics on [state, x], row by row."""
    k = w.shape[0]
    full = np.concatenate([state, x], axis=1).astype(np.float64)
    y = np.zeros(x.shape)
    for t in range(x.shape[1]):
        y[:, t] = np.einsum("bkc,kc->bc", full[:, t:t + k], w) + bias
    new = np.stack([full[i, lengths[i]:lengths[i] + k - 1] for i in range(x.shape[0])])
    return y, new


def test_causal_conv_with_state_and_ragged_rows():
    rng = np.random.default_rng(3)
    b, t, c, k = 3, 7, 10, 4
    x = rng.standard_normal((b, t, c)).astype(np.float32)
    w, bias = rng.standard_normal((k, c)).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    state = rng.standard_normal((b, k - 1, c)).astype(np.float32)
    lengths = np.array([7, 2, 0], np.int32)
    y, new = jax.jit(mamba.causal_conv1d)(x, w, bias, state, lengths)
    y_ref, new_ref = conv_reference(x, w, bias, state, lengths)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new), new_ref.astype(np.float32))
    # a one-token step from the new state equals the reference on the concatenated input
    x2 = rng.standard_normal((b, 1, c)).astype(np.float32)
    y2, _ = mamba.causal_conv1d(x2, w, bias, new, np.ones(b, np.int32))
    for i, n in enumerate(lengths):
        seq = np.concatenate([state[i], x[i, :n], x2[i]])[None]
        ref = conv_reference(seq[:, k - 1:], w, bias, seq[:, :k - 1], np.array([n + 1]))[0][0, -1]
        np.testing.assert_allclose(np.asarray(y2)[i, 0], ref, rtol=1e-5, atol=1e-5)


def test_gated_rms_norm_per_group():
    """Six heads of 2 in 3 groups: each group's 4 channels normalised together (float64 ref)."""
    rng = np.random.default_rng(4)
    y, z = rng.standard_normal((2, 5, 6, 2)), rng.standard_normal((2, 5, 6, 2))
    w = rng.standard_normal((6, 2))
    out = mamba.gated_rms_norm(jnp.asarray(y, jnp.float32), jnp.asarray(z, jnp.float32),
                               jnp.asarray(w, jnp.float32), 1e-5, groups=3)
    g = (y * z / (1 + np.exp(-z))).reshape(2, 5, 3, 4)
    ref = (g / np.sqrt((g * g).mean(-1, keepdims=True) + 1e-5)).reshape(2, 5, 6, 2) * w
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="norm groups"):
        mamba.gated_rms_norm(jnp.ones((1, 5, 2)), jnp.ones((1, 5, 2)), jnp.ones((5, 2)), 1e-5, groups=3)


def _hf_mixer(seed: int):
    import torch
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    torch.manual_seed(seed)
    hf_cfg = Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, expand=2, n_groups=2,
                          state_size=8, conv_kernel=4, chunk_size=8, use_conv_bias=True,
                          use_bias=False, layer_norm_epsilon=1e-5, num_hidden_layers=1)
    m = Mamba2Mixer(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():  # fresh random values everywhere (HF's init sets D = 1, norm = 1)
        for prm in m.parameters():
            prm.copy_(torch.randn_like(prm) * (0.3 if prm.ndim > 1 else 1.0))
        m.dt_bias.copy_(torch.randn(4) - 1.0)
    t = lambda a: jnp.asarray(a.detach().numpy())
    cfg = MambaConfig(n_heads=4, head_dim=16, n_groups=2, d_state=8, d_conv=4, chunk=8)
    params = mamba.from_fused(
        in_proj=t(m.in_proj.weight.T), conv_w=t(m.conv1d.weight[:, 0, :].T), conv_b=t(m.conv1d.bias),
        dt_bias=t(m.dt_bias), A_log=t(m.A_log), D=t(m.D), norm=t(m.norm.weight),
        out_proj=t(m.out_proj.weight.T), cfg=cfg)
    return torch, m, params, cfg


def test_mixer_matches_hf_mamba2_mixer():
    """Prefill of a 13-token sequence through the whole mixer equals HF's Mamba2Mixer (its
    torch path), then token-by-token decode from the cached states equals the full pass."""
    torch, m, params, cfg = _hf_mixer(seed=5)
    x = np.random.default_rng(6).standard_normal((2, 13, 32)).astype(np.float32)
    with torch.no_grad():
        ref = m(torch.from_numpy(x)).numpy()
    conv, ssm = mamba.init_state(cfg, 2)
    run = jax.jit(partial(mamba.mixer, eps=1e-5), static_argnames="cfg")
    full, _, _ = run(params, x, conv, ssm, np.full(2, 13, np.int32), cfg=cfg)
    err = np.abs(np.asarray(full) - ref).max() / np.abs(ref).max()
    assert err < 1e-4, err
    y, conv, ssm = run(params, x[:, :9], conv, ssm, np.full(2, 9, np.int32), cfg=cfg)
    outs = [np.asarray(y)]
    for i in range(9, 13):
        y, conv, ssm = run(params, x[:, i:i + 1], conv, ssm, np.ones(2, np.int32), cfg=cfg)
        outs.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_mixer_ragged_rows():
    """A right-padded row (5 real tokens of 13) gives the same outputs and ends in the same
    states as the row alone."""
    _, _, params, cfg = _hf_mixer(seed=7)
    x = np.random.default_rng(8).standard_normal((2, 13, 32)).astype(np.float32)
    run = jax.jit(partial(mamba.mixer, eps=1e-5), static_argnames="cfg")
    conv, ssm = mamba.init_state(cfg, 2)
    y, conv2, ssm2 = run(params, x, conv, ssm, np.array([13, 5], np.int32), cfg=cfg)
    c1, s1 = mamba.init_state(cfg, 1)
    y_alone, conv_alone, ssm_alone = run(params, x[1:, :5], c1, s1, np.array([5], np.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(y)[1, :5], np.asarray(y_alone)[0], rtol=1e-5, atol=1e-5)
    for got, alone in zip(conv2, conv_alone):  # the x and the B, C conv windows
        np.testing.assert_allclose(np.asarray(got)[1], np.asarray(alone)[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ssm2)[1], np.asarray(ssm_alone)[0], rtol=1e-5, atol=1e-5)
