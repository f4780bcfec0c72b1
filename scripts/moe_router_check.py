"""How much of a MoEfied SmolLM2 layer's loss is the router's: the relative error of one
layer's MLP output with k of E experts, chosen by the fitted router and by an oracle that
knows each expert's true output norm, on eval tokens (the router is fitted on calibration
tokens, as `jaxdec.models.moefy` does). With `--shared N` the N neurons of largest mean
contribution always run and the rest form the experts.

    .venv/bin/python scripts/moe_router_check.py [--layers 2,15,28] [--experts 8]
        [--active 4,2] [--shared 0,384]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

import jaxdec
from jaxdec import corpora
from jaxdec.models import moefy


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="2,15,28")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--active", default="4,2")
    ap.add_argument("--shared", default="0,384")
    a = ap.parse_args(argv)
    e = a.experts
    m = jaxdec.load("smollm2")
    ids = corpora.corpus_token_ids("prose", m.tokenizer.encode)
    windows = lambda split: np.asarray(corpora.make_windows(ids, window=256, split=split, max_windows=4))
    calib = np.asarray(moefy.ffn_inputs(m.params, windows("calib"), m.cfg)).reshape(30, -1, 576)
    evals = np.asarray(moefy.ffn_inputs(m.params, windows("eval"), m.cfg)).reshape(30, -1, 576)
    print(f"relative error of the layer's MLP output with k of {e} experts (eval tokens)")
    for shared_n in map(int, a.shared.split(",")):
        for layer in map(int, a.layers.split(",")):
            p = m.params.layers[layer].ffn
            wd = np.asarray(p.w_down)
            h = np.asarray(moefy._hidden(jnp.asarray(calib[layer]), p.w_gate, p.w_up))
            shared = np.argsort(-(np.abs(h).mean(0) * np.linalg.norm(wd, axis=1)))[:shared_n]
            routed = np.setdiff1d(np.arange(wd.shape[0]), shared)
            order = routed[moefy.group_neurons(h[:, routed], e, seed=layer)]
            per = len(order) // e
            outs = lambda hh: np.einsum("tep,epd->ted", hh[:, order].reshape(-1, e, per),
                                        wd[order].reshape(e, per, -1))
            w, b = moefy.fit_router(calib[layer], np.linalg.norm(outs(h), axis=-1))
            he = np.asarray(moefy._hidden(jnp.asarray(evals[layer]), p.w_gate, p.w_up))
            parts, base = outs(he), he[:, shared] @ wd[shared]
            full = parts.sum(1) + base
            cells = []
            for k in map(int, a.active.split(",")):
                for name, score in (("oracle", np.linalg.norm(parts, axis=-1)),
                                    ("router", evals[layer] @ w + b)):
                    keep = np.zeros(score.shape)
                    np.put_along_axis(keep, np.argsort(-score, axis=1)[:, :k], 1, axis=1)
                    approx = (parts * keep[..., None]).sum(1) + base
                    cells.append(f"{name} k={k}: {np.linalg.norm(approx - full) / np.linalg.norm(full):.2f}")
            print(f"shared {shared_n:4d} layer {layer:2d}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
