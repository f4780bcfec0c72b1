"""Speculative decoding against plain jitted decoding, side by side in one run.

For each drafter: mean accepted length (tokens per target forward), tokens/s, speed-up over
plain greedy decoding of the same prompts, acceptance by draft position, whether the tokens
are identical to plain decoding (they must be), and where a round's time goes (the target's
verification forward, timed alone, and the rest: drafting and bookkeeping).
"""

from __future__ import annotations

import dataclasses
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import jaxdec
from jaxdec import decode
from jaxdec.cache import dense
from jaxdec.models import transformer
from jaxdec.speculative import core, drafters


@dataclasses.dataclass
class Row:
    name: str
    seconds: float
    tokens: int
    identical: bool | None = None
    spec: dict | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _generator(model, prompts, n_new, drafter=None, chat=False):
    """One prompt -> its output (batch 1), compiled by a warm-up generation."""
    if isinstance(prompts[0], str):
        gen = partial(jaxdec.generate, model, max_new_tokens=n_new, drafter=drafter, chat=chat)
    else:  # token rows (corpus prompts)
        gen = partial(jaxdec.api.generate_ids, model, max_new_tokens=n_new, drafter=drafter)
    gen([prompts[0]])
    return lambda p: gen([p])


def _run_interleaved(gens, prompts):
    """[(seconds, tokens, ids, merged stats)] per generator. Every generator decodes a prompt
    before the next prompt starts, so a slow spell of this shared machine (its speed drifts
    by 20% and more over minutes) falls on all of them alike, not on one row."""
    seconds, outs = [0.0] * len(gens), [[] for _ in gens]
    for p in prompts:
        for i, gen in enumerate(gens):
            t0 = time.perf_counter()
            outs[i].append(gen(p))
            seconds[i] += time.perf_counter() - t0
    results = []
    for sec, out in zip(seconds, outs):
        ids = [o.token_ids[0] for o in out]
        results.append((sec, sum(map(len, ids)), ids, _merge([o.spec for o in out])))
    return results


def _merge(specs):
    if not specs or specs[0] is None:
        return None
    if "accepted_hist" not in specs[0]:  # cross-vocabulary stats: weighted by row-rounds
        w = np.array([s["row_rounds"] for s in specs], np.float64)
        mean = lambda key: np.average([s[key] for s in specs], axis=0, weights=w)
        split = {k: sum(s[k] for s in specs) for k in specs[0] if k.startswith("seconds_")}
        return {"mean_accepted": float(mean("mean_accepted")), "rounds": int(w.sum()),
                "accept_by_position": mean("accept_by_position").tolist(), **split}
    hist = np.sum([s["accepted_hist"] for s in specs], axis=0)
    rounds, tokens = sum(s["rounds"] for s in specs), sum(s["tokens"] for s in specs)
    return {"rounds": rounds, "mean_accepted": tokens / max(rounds, 1), "accepted_hist": hist.tolist(),
            "accept_by_position": [float(hist[i:].sum() / max(rounds, 1)) for i in range(1, len(hist))]}


def forward_timer(model, width: int, context: int = 96, steps: int = 16):
    """A function timing one target forward over `width` new tokens after `context` cached
    ones, in milliseconds (a plain decode step is width 1; a verification is the draft's
    width), as the decode loops run it: `steps` forwards chained in one jitted loop (each
    reads the tokens the last one chose and writes the cache); a forward dispatched and
    timed alone also pays the call's own overheads. Compiled here, by a first loop."""
    cfg = model.cfg

    # The decode loops' compiler options: without them XLA:CPU copies every cache layer on
    # every forward (see `decode.COMPILER_OPTIONS`), which the loops never pay.
    @partial(jax.jit, donate_argnums=1, compiler_options=decode.COMPILER_OPTIONS)
    def loop(params, cache, toks):
        pos = cache.lengths[:, None] + jnp.arange(width)[None]

        def body(_, carry):
            toks, cache = carry
            logits, out = transformer.forward(params, toks, pos, cache, cfg)
            return jnp.argmax(logits, -1).astype(toks.dtype), dense.KVCache(out.layers, cache.lengths)

        return jax.lax.fori_loop(0, steps, body, (toks, cache))

    cache = dense.init_cache(cfg, 1, context + width + 64, model.dtype)
    state = [jnp.ones((1, width), jnp.int32), dense.KVCache(cache.layers, jnp.full((1,), context, jnp.int32))]

    def time_once() -> float:
        t0 = time.perf_counter()
        state[0], state[1] = loop(model.params, state[1], state[0])
        state[0].block_until_ready()
        return (time.perf_counter() - t0) * 1e3 / steps

    time_once()
    return time_once


def load_drafter(src: str, model, *, k: int | None = None, method: str = "tli"):
    """A drafter from a bench source: "SRC[@METHOD|@tree=DxKxB][+WEIGHTS]", e.g.
    "smollm2@slem+int4" (a cross-vocabulary method, the drafter's weight format) or
    "DIR@tree=4x4x7+int8" (a checkpoint drafting trees, its weights int8)."""
    src_w, _, weights = src.partition("+")
    name, _, meth = src_w.partition("@")
    tree = meth[len("tree="):] if meth.startswith("tree=") else None
    return drafters.load(name, model, k=k, method=method if tree or not meth else meth,
                         weights=weights or None, tree=tree)


def run(target: str, drafter_srcs: list[str], prompts: list[str], n_new: int, *,
        k: int | None = None, method: str = "tli", dtype: str = "float32", chat=False,
        label: str = "held-out") -> dict:
    model = jaxdec.load(target, dtype=dtype)
    loaded, widths = [], {}
    for src in drafter_srcs:
        drafter = load_drafter(src, model, k=k, method=method)
        loaded.append(drafter)
        if not isinstance(drafter, drafters.CrossVocab):
            widths[src] = core.draft_width(drafter)
    gens = [_generator(model, prompts, n_new, d, chat) for d in [None, *loaded]]
    (sec, n, base_ids, _), *spec_runs = _run_interleaved(gens, prompts)
    rows = [Row("plain decode", sec, n)]
    for src, (sec, n, ids, spec) in zip(drafter_srcs, spec_runs):
        rows.append(Row(src, sec, n, identical=ids == base_ids, spec=spec))
    # the forwards interleaved too: five rounds over every width, medians
    timers = {w: forward_timer(model, w) for w in sorted({1, *widths.values()})}
    times = {w: [] for w in timers}
    for _ in range(5):
        for w, timer in timers.items():
            times[w].append(timer())
    verify_ms = {w: float(np.median(t)) for w, t in times.items()}
    plain_ms = verify_ms[1]
    return {"target": target, "prompts": len(prompts), "label": label, "new_tokens": n_new, "plain_step_ms": plain_ms,
            "rows": [dict(dataclasses.asdict(r), tok_s=r.tok_s, speedup=r.tok_s / rows[0].tok_s,
                          verify_ms=verify_ms.get(widths.get(r.name)))
                     for r in rows]}


def table(report: dict) -> str:
    lines = [f"target {report['target']}: {report['prompts']} {report.get('label', '')} prompts x "
             f"{report['new_tokens']} new tokens, batch 1, greedy; one plain decode step "
             f"{report['plain_step_ms']:.1f} ms",
             f"{'drafter':<34} {'MAL':>5} {'tok/s':>7} {'speed-up':>8} {'same':>5} "
             f"{'ms/round':>8} {'verify':>7} {'ceiling':>7}  acceptance by position"]
    for r in report["rows"]:
        spec = r["spec"] or {}
        mal = spec.get("mean_accepted")
        ms_round = r["seconds"] * 1e3 / spec["rounds"] if spec.get("rounds") else None
        verify = r.get("verify_ms")
        # the speed-up if drafting were free: MAL tokens per verification forward
        ceiling = mal * report["plain_step_ms"] / verify if mal and verify else None
        fmt = lambda x, f: "-" if x is None else format(x, f)
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        by_pos = " ".join(f"{x:.2f}" for x in spec.get("accept_by_position", []))
        lines.append(f"{r['name']:<34} {fmt(mal, '5.2f')} {r['tok_s']:7.1f} {r['speedup']:7.2f}x "
                     f"{same:>5} {fmt(ms_round, '8.1f')} {fmt(verify, '7.1f')} "
                     f"{fmt(ceiling, '6.2f')}x  {by_pos}")
        split = {k[8:]: v for k, v in spec.items() if k.startswith("seconds_")}
        if split:  # cross-vocabulary rounds run on the host: where their time goes
            total = sum(split.values())
            lines.append(f"{'':<34} time: " + ", ".join(
                f"{k} {v / total:.0%}" for k, v in split.items()))
    return "\n".join(lines)


def save(report: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=float)
