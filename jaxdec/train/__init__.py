"""Distilling speculative drafters from a target model.

    model = jaxdec.load("smollm2")
    result = distill(model, "small", "runs/small", TrainConfig(steps=300), n_prompts=256)
    drafter = jaxdec.train.store.load_drafter(result.drafter_path, model)

A Task (a frozen dataclass, one per drafter kind) says what trains and how:
    name: str; taps: tuple[int, ...]        the target taps its batches must carry
    init(rng) -> params                     the trainable drafter params
    frozen(target_model) -> pytree          frozen target arrays the loss reads
    loss(params, frozen, batch, rng) -> (scalar loss, dict of scalar metrics)
    drafter(params) -> a Drafter with params attached
    meta() -> dict                          JSON-able; `jaxdec.train.store` rebuilds from it
    for_target(target_model, dataset, **opts) (classmethod) -> the task
and may offer `taps_for(target_cfg)` (a classmethod; or `default_taps(n_layers)` in its
module): the taps its data needs, known before the data is made. Batches: see `jaxdec.train.data`; the loop: `jaxdec.train.loop`.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
from functools import partial

from jaxdec.errors import JaxdecError
from jaxdec.train.data import (Dataset, concat, heldout_prompts, make_dataset, prompt_set,
                               validation_prompts, window_rows)
from jaxdec.train.loop import TrainConfig, TrainResult, make_evaluator, make_train_step, train

TASKS = {
    "small": "jaxdec.speculative.small_task:SmallDistill",
    "eagle3": "jaxdec.speculative.eagle3:Eagle3Task",
    "pard": "jaxdec.speculative.pard:PardTask",
}


def task_class(kind: str):
    """The Task class of drafter `kind`, imported when first asked for."""
    from jaxdec.train.store import registered

    return registered(TASKS, kind, "drafter kind")


def task_taps(kind: str, cfg) -> tuple[int, ...]:
    """The target layers whose inputs the data of drafter `kind` must carry: the task's
    `taps_for(cfg)`, else its module's `default_taps(n_layers)`, else none."""
    cls = task_class(kind)
    if hasattr(cls, "taps_for"):
        return tuple(cls.taps_for(cfg))
    default = getattr(importlib.import_module(cls.__module__), "default_taps", None)
    return tuple(default(cfg.n_layers)) if default is not None else ()


def make_task(kind: str, target_model, dataset: Dataset, **opts):
    """`for_target` of the kind's Task; options it does not take are a one-line error
    (`layers` reaches a task that calls it `n_layers` under that name)."""
    make = task_class(kind).for_target
    names = inspect.signature(make).parameters
    if "layers" in opts and "layers" not in names and "n_layers" in names:
        opts["n_layers"] = opts.pop("layers")
    try:
        task = make(target_model, dataset, **opts)
    except TypeError as e:
        raise JaxdecError(f"drafter {kind!r}: {e}") from None
    if tuple(task.taps) != dataset.tap_layers:
        raise JaxdecError(f"drafter {kind!r} reads taps {tuple(task.taps)}, the data carries "
                          f"{dataset.tap_layers}")
    return task


def distill(target_model, kind: str, out_dir, cfg: TrainConfig, *, n_prompts: int = 256,
            n_new: int = 64, prompt_len: int = 32, gen_batch: int = 8, temperature: float = 0.0,
            samples: int = 1,
            windows: int = 0, window_len: int = 128, val_prompts: int = 0, cache_dir=None,
            opts: dict | None = None, command: str = "", resume: bool = True,
            stop_after: int | None = None, init_from=None) -> TrainResult:
    """Make (or load) the data of `n_prompts` training prompts (`samples` continuations of
    each at `temperature`; with `windows`, also that many teacher-forced windows of
    `window_len` training-document tokens: see `jaxdec.train.data`), build drafter `kind`'s
    task with `opts`, and train it into `out_dir` (resuming a run found there). With
    `val_prompts`, the target's greedy continuations of that many held-out prompts
    (`validation_prompts`; greedy, as the benches decode) validate the run, and the best
    drafter is kept (see `jaxdec.train.loop`). `init_from`: a saved drafter directory
    to warm-start from (`jaxdec.train.loop.train`)."""
    tok, taps = target_model.tokenizer, task_taps(kind, target_model.cfg)
    prompts = prompt_set(tok, split="train", prompt_len=prompt_len, n=n_prompts)
    make = partial(make_dataset, target_model, taps=taps, batch=gen_batch, seed=cfg.seed,
                   cache_dir=cache_dir)
    val = None
    if val_prompts:
        val = make(validation_prompts(tok, val_prompts, prompt_len=prompt_len), n_new=n_new)
    parts = [make(prompts, n_new=n_new, temperature=temperature, samples=samples)]
    if windows:
        rows = window_rows(tok, window=window_len, n=windows)
        parts.append(make(rows, n_new=0))
    dataset = concat(parts)
    del parts  # the joined copy is what trains
    task = make_task(kind, target_model, dataset, **(opts or {}))
    return train(task, target_model, dataset, cfg, pathlib.Path(out_dir), val=val,
                 resume=resume, command=command, stop_after=stop_after, init_from=init_from)
