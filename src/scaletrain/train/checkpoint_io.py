"""The trainer's side of checkpoints: which format to write, writing it, and choosing what to resume.

``train.checkpoint_format``: ``consolidated`` (one file gathered on rank 0), ``sharded`` (every rank
writes its own pieces, :mod:`.sharded_checkpoint`) or ``auto`` (sharded with several processes).
A runtime whose state has no sharded layout (:func:`~.shard_layouts.unsupported`) is written
consolidated, with the reason logged once. Either format resumes under any layout.

Resuming takes the newest checkpoint that is intact — a sharded one's manifest (every field:
:mod:`.manifest`), file sizes and CRC32s (each rank checks a share of the files), a consolidated
one that loads — and skips damaged newer ones with a one-line warning naming them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.errors import ConfigError, UserError
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import sharded_checkpoint as sharded
from scaletrain.train.config import to_toml
from scaletrain.train.manifest import check_resumable
from scaletrain.train.shard_layouts import group_hyper, layout, unsupported
from scaletrain.train.shards import Piece, canonical_groups, local_of

LAZY_RUNTIMES = ("MeshRuntime", "PipelineStrategy")
"""Runtimes that read a checkpoint key by key (their shards only); others get plain dicts."""


def _agree(tr: Any, value: Any) -> list[Any]:
    """Every rank's ``value`` (collective with several processes)."""
    if tr.world == 1:
        return [value]
    out: list[Any] = [None] * tr.world
    dist.all_gather_object(out, value)
    return out


def chosen_format(tr: Any) -> tuple[str, str | None]:
    """(format to write, why not sharded when asked for). Collective with several processes."""
    fmt = tr.cfg.train.checkpoint_format
    if fmt == "auto":
        fmt = "sharded" if tr.world > 1 else "consolidated"
    if fmt == "consolidated":
        return fmt, None
    reasons = [r for r in _agree(tr, unsupported(tr.parallel, tr.optimizer)) if r]
    return ("consolidated", reasons[0]) if reasons else ("sharded", None)


def save(tr: Any) -> Path | None:
    """Write the trainer's checkpoint of ``tr.step`` in the chosen format (collective). With
    ``train.checkpoint_async`` a sharded save goes on in the background (not the run's last one)."""
    wait(tr)  # the previous background save completes first: saves never overlap
    directory = tr.out_dir / "checkpoints"
    fmt, why = chosen_format(tr)
    if why and not getattr(tr, "_consolidated_noted", False):
        tr.log(f"checkpoint: consolidated format, not sharded ({why})")
        tr._consolidated_noted = True
    if fmt == "consolidated":
        state = tr.state_dict()  # collective with several ranks: all take part, rank 0 writes
        return ckpt.save(directory, tr.step, state, keep=tr.cfg.train.keep_checkpoints) if tr.rank == 0 else None
    background = bool(tr.cfg.train.checkpoint_async) and tr.step < tr.cfg.train.steps
    group = None
    if background and tr.world > 1:
        if getattr(tr, "_checkpoint_group", None) is None:  # its own group: never interleaves with training's
            tr._checkpoint_group = dist.new_group(backend="gloo")
        group = tr._checkpoint_group
    pending = sharded.save(directory, tr.step, *_pieces_and_meta(tr), rank=tr.rank, world=tr.world,
                           keep=tr.cfg.train.keep_checkpoints, rotate=ckpt.rotate, background=background,
                           group=group)
    if background:
        tr._pending_save = pending
        return directory / f"step_{tr.step:08d}"
    return pending.wait()


def wait(tr: Any) -> None:
    """Wait for the trainer's background save, if one is being written (re-raises its error)."""
    pending = getattr(tr, "_pending_save", None)
    if pending is not None:
        tr._pending_save = None
        pending.wait()


def _pieces_and_meta(tr: Any) -> tuple[list[Piece], dict[str, Any]]:
    """This rank's pieces (model, optimizer, its RNG) and the run's metadata for the manifest."""
    opt, model = tr.optimizer, tr.model
    lay = layout(tr.parallel, opt)
    pieces = [p for v, d in lay.values for p in v.pieces(f"model/{v.name}", d)]
    objects: dict[str, Any] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            name, v = lay.optim[id(p)]
            for k, val in opt.state.get(p, {}).items():
                if torch.is_tensor(val):
                    pieces += v.pieces(f"optim/{name}/{k}", local_of(val))
                else:
                    objects[f"{name}/{k}"] = val
    rng = {"torch": tr.parallel.rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    pieces += [Piece(f"rng/{tr.rank}/{k}", tuple(t.shape), (0,) * t.ndim, t) for k, t in rng.items()]
    hyper: dict[int, Any] = {}
    for h, o in _agree(tr, (group_hyper(model, lay, opt), objects)):
        hyper.update(h)
        objects.update(o)
    groups = [{**hyper.get(g, {}), "params": names} for g, names in enumerate(canonical_groups(model))]
    meta = {"plan": tr.plan.to_dict(), "layout": tr.parallel.describe(), "aliases": lay.aliases,
            "param_groups": groups, "optim_objects": objects, "scheduler": tr.scheduler.state_dict(),
            "scaler": tr.scaler.state_dict() if tr.scaler.is_enabled() else {},
            "data": {"samples_seen": tr.step * tr.cfg.train.global_batch, "name": tr.data_name},
            "config": to_toml(tr.cfg)}
    return pieces, meta


def _why_not(tr: Any, path: Path) -> tuple[str | None, dict[str, Any] | None]:
    """(why checkpoint ``path`` cannot be resumed from, or its consolidated state). Collective."""
    if path.is_dir():
        try:
            m = sharded.read_manifest(path)  # every field checked (scaletrain.train.manifest)
            check_resumable(m)
            files = sorted(m["files"])
        except UserError as e:
            files, first = [], str(e)
        else:
            first = None
        why = first or sharded.problem(path, crc_files=files[tr.rank::tr.world])
        why = next((w for w in _agree(tr, why) if w), None)
        return why, None
    try:
        return None, ckpt.load(path)
    except UserError as e:
        return str(e), None


def resume_state(tr: Any) -> tuple[Path, dict[str, Any], list[Path]]:
    """(the newest intact checkpoint, its state for ``Trainer.load_state_dict``, the damaged newer
    ones, skipped with a one-line warning each). ConfigError when none is left."""
    directory = tr.out_dir / "checkpoints"
    found = ckpt.list_checkpoints(directory)
    if not found:
        raise ConfigError(f"--resume: no checkpoint in {str(directory)!r}")
    why, skipped = None, []
    for path in reversed(found):
        why, state = _why_not(tr, path)
        if why is None:
            if state is None:
                state = sharded.Reader(path).state(lazy=type(tr.parallel).__name__ in LAZY_RUNTIMES)
            if state.get("weights_only"):  # imported weights: the run's fresh optimizer, schedule and RNG
                state.update(optimizer=tr.parallel.optimizer_state_dict(tr.optimizer),  # empty at step 0
                             scheduler=tr.scheduler.state_dict(), scaler={}, rng={"torch": tr.parallel.rng_state()})
            return path, state, skipped
        skipped.append(path)
        tr.log(f"warning: skipping damaged checkpoint {path}: {why}")
    raise ConfigError(f"--resume: no intact checkpoint in {str(directory)!r} (the oldest: {why})")
