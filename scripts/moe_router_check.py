"""How much of a MoEfied SmolLM2 layer's loss is the router's: the relative error of one
layer's MLP output with k of E experts, chosen by the fitted router and by an oracle that
knows each expert's true output norm, on eval tokens. Each layer is MoEfied by
`jaxdec.models.moefy.moefy_layer` on calibration tokens exactly as `moefy_model` does (with
`--shared N`, N always-on neurons as a shared expert).

    .venv/bin/python scripts/moe_router_check.py [--layers 2,15,28] [--experts 8]
        [--active 4,2] [--shared 0,384]
"""

from __future__ import annotations

import argparse

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
    m = jaxdec.load("smollm2")
    ids = corpora.corpus_token_ids("prose", m.tokenizer.encode)
    taps = {split: np.asarray(moefy.ffn_inputs(m.params, np.asarray(corpora.make_windows(
        ids, window=256, split=split, max_windows=4)), m.cfg)).reshape(m.cfg.n_layers, -1, m.cfg.d_model)
        for split in ("calib", "eval")}
    print(f"relative error of the layer's MLP output with k of {a.experts} experts (eval tokens)")
    for n_shared in map(int, a.shared.split(",")):
        for layer in map(int, a.layers.split(",")):
            p = moefy.moefy_layer(m.params.layers[layer].ffn, taps["calib"][layer],
                                  n_experts=a.experts, n_shared=n_shared, seed=layer)
            x = taps["eval"][layer]
            parts, base = moefy.expert_outputs(p, x)
            full = parts.sum(1) + base
            cells = []
            for k in map(int, a.active.split(",")):
                for name, score in (("oracle", np.linalg.norm(parts, axis=-1)),
                                    ("router", x @ np.asarray(p.router) + np.asarray(p.router_bias))):
                    keep = np.zeros(score.shape)
                    np.put_along_axis(keep, np.argsort(-score, axis=1)[:, :k], 1, axis=1)
                    approx = (parts * keep[..., None]).sum(1) + base
                    cells.append(f"{name} k={k}: {np.linalg.norm(approx - full) / np.linalg.norm(full):.2f}")
            print(f"shared {n_shared:4d} layer {layer:2d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
