"""Checkpoints seen from outside: find one, describe it, export its model as one safetensors file.

:func:`export_safetensors` streams: the header (names, dtypes, shapes, offsets) is known from the
manifest (or a memory-mapped consolidated file) before any tensor is read, then each tensor is
assembled from its pieces, written and dropped — the process never holds more than one tensor.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import torch

from scaletrain.errors import UserError
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import runlock
from scaletrain.train import sharded_checkpoint as sharded
from scaletrain.train.manifest import BadManifest, check_key
from scaletrain.train.safe_write import write_atomic

ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
_ST_NAMES = set(ST_DTYPES.values())
"""safetensors dtypes an import accepts: exactly the checkpoint's (:data:`.manifest.DTYPES`)."""


def resolve(target: Path) -> Path:
    """The checkpoint ``target`` names: a checkpoint file or directory, a run's ``checkpoints/``
    directory, or a run directory (its newest checkpoint). UserError if there is none."""
    if not target.exists():
        raise UserError(f"{str(target)!r} does not exist; give a run directory or a checkpoint")
    if ckpt._NAME.match(target.name) and (target.is_file() or (target / sharded.MANIFEST).exists()):
        return target
    for d in (target / "checkpoints", target):
        found = ckpt.list_checkpoints(d) if d.is_dir() else []
        if found:
            return found[-1]
    raise UserError(f"{str(target)!r} holds no checkpoint (step_N.pt or step_N/ with {sharded.MANIFEST})")


def _tomlish(config: str) -> dict[str, Any]:
    import tomllib

    try:
        return tomllib.loads(config) if config else {}
    except tomllib.TOMLDecodeError:
        return {}


def info(path: Path, verify: bool = True) -> dict[str, Any]:
    """What a checkpoint holds: format, step, the plan it was written under, sizes (bytes)."""
    if path.is_dir():
        try:
            m = sharded.read_manifest(path)
        except BadManifest as e:  # a damaged checkpoint: said as such, nothing of it is read
            return {"path": str(path), "format": "sharded", "step": None, "world": None, "layout": "", "plan": {},
                    "parameters": None, "tensors": None, "bytes": None, "files": {}, "problem": str(e)}
        files = {k: v["bytes"] for k, v in m["files"].items()}
        aliases = m.get("aliases", {})  # tied tensors: counted once
        model = {k[6:]: v for k, v in m["tensors"].items() if k.startswith("model/") and k[6:] not in aliases}
        return {"path": str(path), "format": "sharded", "step": m["step"], "world": m["world"],
                "layout": m.get("layout", ""), "plan": _resolved(m.get("plan", {}), m["world"]),
                "parameters": sum(math.prod(v["shape"]) for v in model.values()), "tensors": len(model),
                "bytes": sum(files.values()) + (path / sharded.MANIFEST).stat().st_size, "files": files,
                "problem": sharded.problem(path, crc_files=None if verify else [])}
    state = ckpt.load(path)
    par = _tomlish(state.get("config", "")).get("parallel", {})
    model = state["model"]
    world = len(state.get("rng_ranks") or [None])
    unique = {(v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)): v  # tied tensors: once
              for v in model.values() if torch.is_tensor(v)}
    return {"path": str(path), "format": "consolidated", "step": int(state["step"]),
            "world": world, "layout": "", "plan": _resolved(par, world),
            "parameters": sum(v.numel() for v in unique.values()), "tensors": len(model),
            "bytes": path.stat().st_size, "files": {path.name: path.stat().st_size}, "problem": None}


def _resolved(plan: dict[str, Any], world: int) -> dict[str, Any]:
    """``plan`` with ``dp=0`` ("every process") replaced by the replicas it meant: world / (tp x pp x cp)."""
    if plan.get("dp") != 0:
        return plan
    model_ranks = math.prod(int(plan.get(k, 1) or 1) for k in ("tp", "pp", "cp"))
    return {**plan, "dp": max(world // model_ranks, 1)}


def _model_tensors(path: Path) -> tuple[list[tuple[str, torch.dtype, list[int]]], Any, dict[str, str]]:
    """(name, dtype, shape) of every model tensor, a function reading one, tied aliases."""
    if path.is_dir():
        why = sharded.problem(path)  # every file's CRC32 too: a damaged checkpoint is never exported
        if why:
            raise UserError(f"checkpoint {str(path)!r} is damaged, not exported: {why} (`scaletrain checkpoint info` "
                            f"describes it; an older checkpoint of the run may be intact)")
        r = sharded.Reader(path)
        heads = [(k[6:], getattr(torch, v["dtype"]), v["shape"]) for k, v in r.tensors.items()
                 if k.startswith("model/")]
        return heads, lambda n: r.read("model/" + n), dict(r.manifest.get("aliases", {}))
    try:  # memory-mapped: tensors are paged in one at a time as they are written
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise UserError(f"checkpoint {str(path)!r} cannot be loaded ({str(e).splitlines()[0][:120]})") from None
    model = state["model"]
    seen: dict[tuple, str] = {}  # tied tensors share storage in the file: written once
    heads, aliases = [], {}
    for n, t in model.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            aliases[n] = seen[key]
            continue
        seen[key] = n
        heads.append((n, t.dtype, list(t.shape)))
    return heads, lambda n: model[n], aliases


Rename = Callable[[str], "tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None"]
"""Maps a single-process name to (name in the file, transform of the tensor), or None to leave it out."""


def saved_config(path: Path) -> str:
    """The TOML config the checkpoint was written under ("" when not recorded)."""
    if path.is_dir():
        return str(sharded.read_manifest(path).get("config", "") or "")
    return str(ckpt.load(path).get("config", "") or "")


def export_safetensors(path: Path, out: Path, rename: Rename | None = None,
                       metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Write the model of checkpoint ``path`` to ``out`` (safetensors, single-process names; a tied
    parameter once, its other names in the metadata). ``rename`` gives another layout's names
    (:mod:`.export_hf`). Returns what was written."""
    heads, read, aliases = _model_tensors(path)
    if rename is not None:  # shapes after the transform, from a meta tensor: nothing is read yet
        mapped = [(n, rename(n)) for n, _, _ in heads]
        fns = {new: (n, fn) for n, m in mapped if m is not None for new, fn in [m]}
        old = {n: (dt, shape) for n, dt, shape in heads}
        heads = [(new, old[n][0], list(fn(torch.empty(old[n][1], dtype=old[n][0], device="meta")).shape))
                 for new, (n, fn) in fns.items()]
        base = read
        read = lambda new: fns[new][1](base(fns[new][0]))  # noqa: E731
        aliases = {}
    for n, dt, _ in heads:
        if dt not in ST_DTYPES:
            raise UserError(f"tensor {n!r} has dtype {dt}, which safetensors cannot hold")
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "scaletrain_aliases": json.dumps(aliases),
                                               **(metadata or {})}}
    pos = 0
    for n, dt, shape in heads:
        nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        header[n] = {"dtype": ST_DTYPES[dt], "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(f: Any) -> None:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for n, _, _ in heads:
            t = read(n).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            del t

    try:  # a fresh temp name beside ``out`` (by default inside the run directory): no symlink is followed
        write_atomic(out, write)
    except OSError as e:
        raise UserError(f"could not write {str(out)!r} ({e.strerror or e})") from None
    return {"path": str(out), "tensors": len(heads), "bytes": out.stat().st_size, "aliases": aliases}


def import_safetensors(src: Path, run: Path) -> dict[str, Any]:
    """Write the weights of safetensors file ``src`` as the step-0 checkpoint of a new run directory
    ``run`` (model only: ``scaletrain train --out RUN --resume`` starts from them with a fresh
    optimizer), streamed one tensor at a time. The tensors must carry the model's single-process
    names (as :func:`export_safetensors` writes them); the run's model checks them when it loads."""
    if not src.is_file():
        raise UserError(f"{str(src)!r} is not a file; give a .safetensors file")
    if run.exists() and (not run.is_dir() or any(run.iterdir())):
        raise UserError(f"--out {str(run)!r} exists and is not empty; an existing run is never written into")
    f, names, aliases = _read_names(src)
    from scaletrain.train.shards import Piece

    def pieces():
        for n in names:
            t = f.get_tensor(n)
            yield Piece(f"model/{n}", tuple(t.shape), (0,) * t.ndim, t)

    lock = runlock.acquire(run)  # one job per run directory; released (and an empty run removed) on failure
    try:
        tmp, final = sharded.new_tmp(run / "checkpoints", 0)
        entries, nbytes, crc = sharded.write_pieces(tmp / sharded.rank_file(0), pieces())
        meta = {"weights_only": True, "aliases": aliases, "plan": {}, "layout": f"imported from {src.name}"}
        report = {"file": sharded.rank_file(0), "bytes": nbytes, "crc32": crc, "pieces": entries}
        sharded.commit(tmp, final, 0, meta, [report], 1)
    except OSError as e:
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
        raise UserError(f"could not write {str(run)!r} ({e.strerror or e})") from None
    finally:
        lock.release()
    return {"path": str(final), "tensors": len(names), "bytes": nbytes}


def _read_names(src: Path) -> tuple[Any, list[str], dict[str, str]]:
    """(the open safetensors file, its tensor names, its tied aliases), every name checked like a
    manifest's (:func:`.manifest.check_key`: names, never paths) and every dtype allowed."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(str(src), framework="pt")
        names = list(f.keys())
        aliases = json.loads((f.metadata() or {}).get("scaletrain_aliases", "{}"))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{str(src)!r} is not a safetensors file ({str(e).splitlines()[0][:120]})") from None
    try:
        if not isinstance(aliases, dict):
            raise BadManifest("the scaletrain_aliases metadata is not an object of name -> name")
        for n in names:
            check_key(n)
            dtype = str(f.get_slice(n).get_dtype())
            if dtype not in _ST_NAMES:
                raise BadManifest(f"tensor {n!r} has dtype {dtype}; allowed: {', '.join(sorted(_ST_NAMES))}")
        for alias, target in aliases.items():
            check_key(alias, "alias")
            if target not in names:
                raise BadManifest(f"alias {alias!r} names {str(target)[:80]!r}, which is not a tensor of the file")
    except BadManifest as e:
        raise UserError(f"{str(src)!r} cannot be imported: {e}") from None
    return f, names, aliases
