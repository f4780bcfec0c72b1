"""The training loop: one jitted step, orbax checkpoints, and a resume that continues exactly.

    cfg = TrainConfig(steps=1000, batch_size=8, lr=3e-4, warmup=50)
    result = train(task, target_model, dataset, cfg, "runs/small")

Each step is `train_step(state, frozen, batch)`, jitted with the state donated: AdamW on
the task's loss, gradients clipped to a global norm, a warmup then cosine schedule. Batch
`s` is `dataset.batch(s, batch_size, seed)` and the step's key is `fold_in(rng, s)`, so
everything step `s` does is a function of the state and `s`. The whole `TrainState` is
checkpointed every `ckpt_every` steps and at the end (orbax writes each into a temporary
directory and renames it; the last two are kept); a run started on an `out_dir` that
holds one continues from the latest, and produces the losses it would have produced
uninterrupted. `out_dir/metrics.jsonl` gets one line per logged step: step, loss, the
task's metrics, grad_norm, lr, and seconds since this call started training.

Given validation data (`train(..., val=dataset)`: the target's continuations of held-out
prompts), every `eval_every` steps and at the end the loss and the task's metrics are
averaged over it (whole batches of `batch_size` rows, a fixed key) and logged on that
step's line as `val_loss`, `val_<metric>`. A task with `draft_chains` (EAGLE-3) on greedy
validation data also gets `val_mal` and `val_accept_<j>`: greedy chain speculation
replayed on those rows (`replay_chains`), the mean accepted length and acceptance by
position a bench would measure on those prompts, from one teacher-forced pass. The params with the lowest `val_loss` so far are
saved as a drafter in `out_dir/best` (their step and values in its drafter.json, under
"val"), so a run that trained past its best still hands the best one over; a resumed run
takes the best so far from there.

`train(..., init_from=DIR)` warm-starts a fresh run from the params of a drafter saved in
DIR (the same kind, shapes and vocabulary map; `jaxdec.train.store.load_params`), with a
new optimiser state and schedule: to train a drafter further, or on other data. The run
records DIR, and resuming it continues from its own checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdec.errors import JaxdecError
from jaxdec.files import write_text_atomic
from jaxdec.ops import cpu_kernel

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
BEST_DIR = "best"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int
    batch_size: int = 8
    lr: float = 3e-4
    warmup: int = 0  # linear warmup steps
    schedule: str = "cosine"  # "cosine" (to 10% of lr at the end) or "constant"
    weight_decay: float = 0.0  # AdamW's, on matrices only (not norms or biases)
    b1: float = 0.9
    b2: float = 0.95
    clip: float = 1.0  # global gradient norm
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 100
    eval_every: int = 100  # steps between validation passes (when there is validation data)

    def __post_init__(self):
        if min(self.steps, self.batch_size, self.log_every, self.ckpt_every,
               self.eval_every) < 1:
            raise JaxdecError("steps, batch_size, log_every, ckpt_every and eval_every must be "
                              "positive")
        if not 0 <= self.warmup < self.steps:
            raise JaxdecError(f"warmup must be in [0, steps) (got {self.warmup} of {self.steps})")
        if self.schedule not in ("cosine", "constant"):
            raise JaxdecError(f"unknown schedule {self.schedule!r} (cosine or constant)")
        if not (self.lr > 0 and self.clip > 0):
            raise JaxdecError(f"lr and clip must be positive (got {self.lr}, {self.clip})")


@partial(jax.tree_util.register_dataclass,
         data_fields=["step", "params", "opt_state", "rng"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # i32[]: steps taken
    params: Any  # the task's trainable pytree
    opt_state: Any  # optax state of `params`
    rng: jax.Array  # u32[2]: the run's base key (raw, so orbax stores it as an array)


def schedule(cfg: TrainConfig) -> optax.Schedule:
    if cfg.schedule == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup),
                                     optax.constant_schedule(cfg.lr)], [cfg.warmup])
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                              end_value=cfg.lr * 0.1)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with `schedule(cfg)`; no decay on 1-D arrays."""
    matrices = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                                   weight_decay=cfg.weight_decay, mask=matrices))


def init_state(task, optimizer, seed: int) -> TrainState:
    init_key, rng = jax.random.split(jax.random.PRNGKey(seed))
    params = task.init(init_key)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                       opt_state=optimizer.init(params), rng=rng)
    return jax.device_put(state, jax.devices()[0])  # committed, as every later state is


def make_train_step(task, optimizer):
    """train_step(state, frozen, batch) -> (state, metrics): one AdamW step on the task's
    loss, jitted, the state donated. metrics holds "loss", "grad_norm" and the task's own."""

    def train_step(state: TrainState, frozen, batch):
        key = jax.random.fold_in(state.rng, state.step)
        grad_fn = jax.value_and_grad(task.loss, has_aux=True)
        with cpu_kernel.xla_only():  # the CPU kernels have no derivatives
            (loss, metrics), grads = grad_fn(state.params, frozen, batch, key)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                          rng=state.rng), metrics

    return jax.jit(train_step, donate_argnums=0)


def make_evaluator(task, dataset, batch_size: int, seed: int):
    """evaluate(params, frozen) -> {"val_loss": ..., "val_<metric>": ...}: the task's loss
    and metrics averaged over the batches of `dataset` (consecutive rows in whole batches of
    min(batch_size, rows); a ragged tail is left out), each batch with its own fixed key;
    with `draft_chains` on greedy rows also val_mal and val_accept_<j> (`replay_chains`).
    One jitted call maps over all the batches."""
    bs = min(batch_size, len(dataset))
    n = len(dataset) // bs
    rows = dataset.rows(np.arange(n * bs))
    stacked = {k: v.reshape(n, bs, *v.shape[1:]) for k, v in rows.items()}
    keys = jax.vmap(partial(jax.random.fold_in, jax.random.PRNGKey(seed)))(jnp.arange(n))
    # greedy rows: the next token is the target's, so drafts can be checked against it
    chains = (hasattr(task, "draft_chains") and dataset.meta.get("n_new")
              and dataset.meta.get("temperature") == 0)

    @jax.jit
    def run(params, frozen, stacked, keys):
        def one(xs):
            batch, key = xs
            with cpu_kernel.xla_only():  # as the training step computes it
                loss, metrics = task.loss(params, frozen, batch, key)
                drafts = task.draft_chains(params, frozen, batch) if chains else None
            return {**metrics, "loss": loss}, drafts
        metrics, drafts = jax.lax.map(one, (stacked, keys))
        return jax.tree.map(jnp.mean, metrics), drafts

    def evaluate(params, frozen) -> dict[str, float]:
        means, drafts = jax.device_get(run(params, frozen, stacked, keys))
        out = {f"val_{k}": float(v) for k, v in means.items()}
        if chains:  # [n, k, bs, T] -> [k, n * bs, T], the rows' order
            drafts = np.moveaxis(drafts, 0, 1).reshape(drafts.shape[1], n * bs, -1)
            hist, emitted = replay_chains(drafts, rows["tokens"], rows["mask"])
            out.update(chain_stats(hist, emitted, prefix="val_"))
        return out

    return evaluate


def chain_stats(hist, emitted: int, prefix: str = "") -> dict[str, float]:
    """{mal, accept_1..k} of a replay's (hist, emitted), as `jaxdec.speculative.core.stats`."""
    rounds = max(int(hist.sum()), 1)
    return {f"{prefix}mal": emitted / rounds,
            **{f"{prefix}accept_{j}": float(hist[j:].sum()) / rounds for j in range(1, len(hist))}}


def replay_chains(drafts, tokens, mask, n_new: int | None = None):
    """Greedy chain speculation replayed on rows of the target's greedy continuations ->
    (hist i64[k + 1]: rounds that accepted exactly a drafts, tokens the rounds emitted).

    drafts i32[k, B, T] (a task's `draft_chains`: [j, :, i] proposes x_{i+j+2} from the
    context ending at i); tokens [B, T]; mask [B, T], 1 on the generated tokens. As
    `jaxdec.speculative.core` decodes: the prefill gives each row's first new token, then each
    round drafts k tokens from the context so far, keeps the longest prefix that matches
    the target's tokens and adds the target's next one, until `n_new` tokens (default: all
    the row's generated ones; drafts are checked against every generated token there is).
    Emitted tokens leave the prefill's out and stop at `n_new`, as `core.stats` counts
    them, so emitted / rounds is the mean accepted length."""
    k = drafts.shape[0]
    hist, emitted = np.zeros(k + 1, np.int64), 0
    for r in range(tokens.shape[0]):
        gen = np.flatnonzero(np.asarray(mask[r]) > 0)
        if len(gen) == 0:
            continue
        start, end = int(gen[0]), int(gen[-1]) + 1
        n = end - start if n_new is None else min(n_new, end - start)
        i, produced = start - 1, 1  # the context ends at i; x_{i+1} is known
        while produced < n:
            a = 0
            while a < k and i + a + 2 < end and drafts[a, r, i] == tokens[r, i + a + 2]:
                a += 1
            hist[a] += 1
            emitted += min(a + 1, n - produced)
            produced, i = produced + a + 1, i + a + 1
    return hist, emitted


@dataclasses.dataclass(frozen=True)
class TrainResult:
    params: Any  # the trained params
    drafter_path: pathlib.Path  # where store.save_drafter wrote them
    history: list[dict]  # the metrics lines this call logged
    best_path: pathlib.Path | None = None  # the lowest-val_loss drafter (with validation data)


def train(task, target_model, dataset, cfg: TrainConfig, out_dir, *, val=None,
          resume: bool = True, command: str = "", stop_after: int | None = None,
          init_from=None) -> TrainResult:
    """Train `task` on `dataset`, checkpointing into `out_dir` (see the module docstring);
    save the drafter to `out_dir/drafter`, and with validation data `val` the best one to
    `out_dir/best`; with `init_from`, a fresh run starts from that drafter's params.
    `stop_after` (a debugging aid for the resume test) ends the process
    with os._exit right after step `stop_after`'s checkpoint."""
    from tqdm import tqdm

    from jaxdec.train import store

    out = pathlib.Path(out_dir).absolute()
    init_from = None if init_from is None else pathlib.Path(init_from).absolute()
    _claim(out, _run_record(task, target_model, dataset, cfg, val, init_from), resume)
    optimizer = make_optimizer(cfg)
    manager = _manager(out / "ckpt")
    state, start = _restore_or_init(manager, task, optimizer, cfg.seed, resume)
    if start == 0 and init_from is not None:
        params = store.load_params(init_from, task, state.params, target_model)
        state = dataclasses.replace(state, params=params, opt_state=optimizer.init(params))
    history = _trim_metrics(out / METRICS_FILE, start)
    step_fn, frozen = make_train_step(task, optimizer), task.frozen(target_model)
    evaluate = None if val is None else make_evaluator(task, val, cfg.batch_size, cfg.seed)
    best = _best_so_far(out / BEST_DIR) if val is not None else None
    meta = {"target": store.target_info(target_model), "command": command,
            "train": dataclasses.asdict(cfg), "data": dataset.meta}
    lr = jax.jit(schedule(cfg))  # on the host, once compiled
    t0 = time.perf_counter()
    with tqdm(total=cfg.steps, initial=start, desc=f"training {task.name}", unit="step",
              file=sys.stderr, disable=None) as bar, open(out / METRICS_FILE, "a") as log:
        for s in range(start, cfg.steps):
            state, metrics = step_fn(state, frozen, dataset.batch(s, cfg.batch_size, cfg.seed))
            last = s + 1 == cfg.steps
            evaluating = evaluate is not None and ((s + 1) % cfg.eval_every == 0 or last)
            if (s + 1) % cfg.log_every == 0 or last or evaluating:
                line = _log_line(s + 1, metrics, float(lr(s)), time.perf_counter() - t0)
                if evaluating:
                    line.update(evaluate(state.params, frozen))
                    if best is None or line["val_loss"] < best["val_loss"]:
                        best = {"step": s + 1, **{k: v for k, v in line.items()
                                                  if k.startswith("val_")}}
                        store.save_drafter(out / BEST_DIR, task, state.params,
                                           {**meta, "val": best})
                log.write(json.dumps(line) + "\n")
                log.flush()
                history.append(line)
                bar.set_postfix(loss=f"{line['loss']:.4f}", **(
                    {"val_loss": f"{line['val_loss']:.4f}"} if "val_loss" in line else {}))
            bar.update(1)
            if (s + 1) % cfg.ckpt_every == 0 or s + 1 == cfg.steps:
                manager.save(s + 1, args=_save_args(state))
                if stop_after is not None and s + 1 >= stop_after:
                    manager.wait_until_finished()
                    os._exit(0)  # as a kill would: no cleanup
    manager.wait_until_finished()
    path = store.save_drafter(out / "drafter", task, state.params, meta)
    return TrainResult(params=state.params, drafter_path=path, history=history,
                       best_path=None if val is None else out / BEST_DIR)


def _best_so_far(path: pathlib.Path) -> dict | None:
    """The "val" record of the best drafter a run already saved (a resumed run), or None."""
    from jaxdec.train import store

    return store.read_meta(path).get("val") if (path / store.META).is_file() else None


def _log_line(step: int, metrics, lr: float, seconds: float) -> dict:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    return {"step": step, "loss": values.pop("loss"), **values, "lr": lr,
            "seconds": round(seconds, 3)}


def _run_record(task, target_model, dataset, cfg: TrainConfig, val=None,
                init_from: pathlib.Path | None = None) -> dict:
    from jaxdec.train import store

    record = {"task": task.meta(), "target": store.target_info(target_model),
              "data": dataset.meta, "train": dataclasses.asdict(cfg)}
    if val is not None:
        record["val"] = val.meta
    if init_from is not None:
        record["init"] = str(init_from)
    return json.loads(json.dumps(record))


def _claim(out: pathlib.Path, record: dict, resume: bool) -> None:
    """Write `out/run.json`; a run already there must be this one (same task, data and
    settings) to be resumed, and is refused when resume=False."""
    path = out / RUN_FILE
    if path.is_file():
        if not resume:
            raise JaxdecError(f"{out} already holds a training run; resume it or use another "
                              "output directory")
        try:
            previous = json.loads(path.read_text())
        except ValueError:
            raise JaxdecError(f"{path}: unreadable; use another output directory") from None
        if previous != record:
            changed = sorted(k for k in record if previous.get(k) != record[k])
            raise JaxdecError(f"{out} holds a run with other settings ({', '.join(changed)}); "
                              "use another output directory")
        return
    write_text_atomic(path, json.dumps(record, indent=1))


def _manager(directory: pathlib.Path):
    import orbax.checkpoint as ocp

    # synchronous: the next step donates the state's buffers, which must be written by then
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory, options=options)


def _save_args(state: TrainState):
    import orbax.checkpoint as ocp

    return ocp.args.StandardSave(state)


def _restore_or_init(manager, task, optimizer, seed: int, resume: bool):
    """(state, first step): the latest checkpoint's, or a fresh state at step 0."""
    import orbax.checkpoint as ocp

    fresh = init_state(task, optimizer, seed)
    latest = manager.latest_step() if resume else None
    if latest is None:
        return fresh, 0
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fresh)
    try:
        state = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # orbax raises many types for damaged checkpoints
        raise JaxdecError(f"cannot resume from checkpoint {latest} ({e.__class__.__name__}); "
                          "delete it or use another output directory") from None
    return state, int(state.step)


def _trim_metrics(path: pathlib.Path, start: int) -> list[dict]:
    """Keep the metrics lines up to step `start` (a killed run may have logged past its last
    checkpoint; those steps run again); return them."""
    if not path.is_file():
        return []
    kept = [ln for ln in _parse_lines(path) if ln["step"] <= start]
    write_text_atomic(path, "".join(json.dumps(ln) + "\n" for ln in kept))
    return kept


def read_metrics(out_dir) -> list[dict]:
    """The metrics lines of a run directory."""
    return _parse_lines(pathlib.Path(out_dir) / METRICS_FILE)


def _parse_lines(path: pathlib.Path) -> list[dict]:
    """JSON lines; a torn last line (the process killed mid-write) is dropped."""
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:
            continue
    return lines
