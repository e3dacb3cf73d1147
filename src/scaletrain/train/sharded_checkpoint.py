"""Sharded checkpoints: every rank writes only its own pieces, in parallel; any layout reads them.

On disk, one directory per checkpoint::

    step_00000010/
      rank_00000.bin ...   raw tensor bytes, one file per rank (its pieces back to back)
      manifest.json        written last: step, the plan and layout it was written under, world
                           size, every file's size and CRC32, every tensor's pieces (key, shape,
                           dtype, offsets, sizes, file, byte offset), scheduler / scaler / data
                           position, the optimizer's groups by parameter name

Why an own format rather than ``torch.distributed.checkpoint``: the runtimes' local tensors are
not all DTensors of the single-process tensor (ZeRO-1/2 owned rows of a TP shard, the fused-QKV
row permutation, pipeline stages), and DCP's metadata is a pickle, which scaletrain never loads.
Pieces are boxes of the single-process tensors (:mod:`.shards`), so any layout reads the rows it
needs and nothing is re-gathered to save.

Atomicity: all ranks write into ``step_XXXXXXXX.tmp-<id>/``; after every rank has fsynced its file,
rank 0 writes the manifest and renames the directory into place. A directory counts as a
checkpoint only with a sound manifest (every field checked, piece files are names inside the
directory, never paths: :mod:`.manifest`) whose files exist as plain files with the recorded sizes
(:func:`problem`), and a resume also checks their CRC32 (each rank a share of the files). Loading
needs no pickle: tensors are raw bytes read with ``torch.frombuffer``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from scaletrain.errors import UserError
from scaletrain.train import faults, manifest
from scaletrain.train.manifest import BadManifest
from scaletrain.train.safe_write import fsync_dir, open_new, write_atomic
from scaletrain.train.shards import Piece, assign, coverage_errors

FORMAT = "scaletrain-sharded/1"
MANIFEST = "manifest.json"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.bin"


def _json_default(o: Any) -> Any:
    if torch.is_tensor(o) and o.numel() == 1:
        return o.item()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"{type(o).__name__} is not JSON-serialisable")


def write_pieces(path: Path, pieces: Iterable[Piece], after_first: Callable[[], None] | None = None
                 ) -> tuple[list[dict[str, Any]], int, int]:
    """Write ``pieces`` back to back into ``path`` (fsynced): (their index entries, bytes, CRC32).
    ``pieces`` may be a generator: one piece is in memory at a time. ``after_first``: called once
    the first piece is on disk (the fault injector's mid-save point, :mod:`.faults`)."""
    entries, pos, crc = [], 0, 0
    with open_new(path) as f:  # a fresh name in a fresh directory: never a pre-placed symlink
        for i, p in enumerate(pieces):
            if i == 1 and after_first is not None:
                f.flush()
                after_first()
            t = p.data.contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            f.write(raw)
            crc = zlib.crc32(raw, crc)
            entries.append({"key": p.key, "shape": list(p.shape), "dtype": str(t.dtype).split(".")[-1],
                            "offset": list(p.offsets), "size": list(t.shape), "byte": pos, "nbytes": len(raw)})
            pos += len(raw)
        f.flush()
        os.fsync(f.fileno())
    return entries, pos, crc


def save(directory: Path, step: int, pieces: list[Piece], meta: dict[str, Any], *, rank: int, world: int,
         keep: int, rotate: Callable[[Path, int], None] | None = None, background: bool = False,
         group: Any = None) -> "PendingSave":
    """Write this rank's ``pieces`` of the checkpoint of ``step`` (collective: every rank calls it).

    ``meta``: JSON-serialisable (rank 0's is recorded). Replicated boxes are split between their
    holders (:func:`~.shards.assign`); ``rotate(directory, keep)`` is called on rank 0 after the
    rename. Returns a :class:`PendingSave` whose ``wait()`` returns the checkpoint directory once it
    is complete on every rank. ``background``: this rank's pieces are copied (its shards only), then
    written by a thread while training goes on; its collectives run on ``group`` (a process group of
    their own, so they never interleave with the training's)."""
    final = directory / f"step_{step:08d}"
    name = [new_tmp(directory, step)[0].name] if rank == 0 else [None]
    if world > 1:
        dist.broadcast_object_list(name, src=0)
    tmp = directory / str(name[0])
    offers = [(p.key, p.offsets, tuple(p.data.shape)) for p in pieces]
    everyone = [offers]
    if world > 1:
        everyone = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(everyone, offers)
    share = assign(everyone, rank)
    mine = []
    for p, box in zip(pieces, offers):
        start, rows = share[box]
        if rows == 0:
            continue
        data = p.data.narrow(0, start, rows) if p.data.ndim else p.data
        mine.append(Piece(p.key, p.shape, (p.offsets[0] + start, *p.offsets[1:]) if p.offsets else (),
                          data.clone() if background else data))  # a snapshot: training changes the tensors

    def gather(value: Any) -> list[Any]:
        out = [value]
        if world > 1:
            out = [None] * world
            dist.all_gather_object(out, value, group=group)
        return out

    def finish() -> Path:
        # a rank that cannot write (disk full, permissions) still reports, so every rank fails alike
        try:
            entries, nbytes, crc = write_pieces(tmp / rank_file(rank), mine, lambda: faults.maybe_fire(
                step, rank, directory.parent, "async-save" if background else "save"))
            report: dict[str, Any] = {"file": rank_file(rank), "bytes": nbytes, "crc32": crc, "pieces": entries}
        except OSError as e:
            report = {"error": f"rank {rank} could not write {tmp / rank_file(rank)} ({e.strerror or e})"}
        reports = gather(report)  # also: every rank's file is written and fsynced
        error = next((r["error"] for r in reports if "error" in r), None)  # the same on every rank
        written = error is None
        if rank == 0 and written:
            try:
                commit(tmp, final, step, meta, reports, world)
                if rotate is not None:
                    rotate(directory, keep)
            except (OSError, RuntimeError) as e:
                error = f"rank 0 could not commit {final} ({getattr(e, 'strerror', None) or e})"
        if written:  # rank 0's verdict on the commit; nobody goes on before the checkpoint exists
            error = gather(error)[0]
        if error is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"checkpoint of step {step} not written: {error}; the previous checkpoints are intact")
        return final

    return PendingSave(finish, background)


class PendingSave:
    """A save being written (``background``) or already written; :meth:`wait` returns its directory
    and re-raises what went wrong in the writer."""

    def __init__(self, finish: Callable[[], Path], background: bool) -> None:
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(finish,), name="checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            self._result = finish()

    def _run(self, finish: Callable[[], Path]) -> None:
        try:
            self._result = finish()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread at wait()
            self._error = e

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def new_tmp(directory: Path, step: int) -> tuple[Path, Path]:
    """(a fresh temporary directory for the checkpoint of ``step``, its final name)."""
    final = directory / f"step_{step:08d}"
    tmp = directory / f"{final.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir(parents=True)
    return tmp, final


def commit(tmp: Path, final: Path, step: int, meta: dict[str, Any], reports: list[Any], world: int) -> None:
    """Write the manifest (last) from every rank's report and rename ``tmp`` to ``final``."""
    tensors: dict[str, dict[str, Any]] = {}
    for r in reports:
        for e in r["pieces"]:
            t = tensors.setdefault(e["key"], {"shape": e["shape"], "dtype": e["dtype"], "pieces": []})
            t["pieces"].append({"file": r["file"], "offset": e["offset"], "size": e["size"], "byte": e["byte"],
                                "nbytes": e["nbytes"], "dtype": e["dtype"]})
    bad = coverage_errors(tensors)
    if bad:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"sharded checkpoint would not hold every element exactly once: {bad[:3]}")
    manifest = {"format": FORMAT, "step": step, "world": world, **meta,
                "files": {r["file"]: {"bytes": r["bytes"], "crc32": r["crc32"]} for r in reports},
                "tensors": dict(sorted(tensors.items()))}
    write_atomic(tmp / MANIFEST, json.dumps(manifest, default=_json_default, indent=1))
    if final.exists():  # the same step saved again: the old one goes only once the new one is complete
        old = final.with_name(final.name + f".old-{time.time_ns()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


# ------------------------------------------------------------------------------------ reading
def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path``, checked field by field (:mod:`.manifest`); a
    missing, foreign or unsound one is a UserError (a :class:`~.manifest.BadManifest` for the last)."""
    f = path / MANIFEST
    try:
        st = f.lstat()
    except OSError:
        raise UserError(f"checkpoint {str(path)!r} has no {MANIFEST} (incomplete)") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > manifest.MAX_MANIFEST_BYTES:
        raise BadManifest(f"checkpoint {str(path)!r}: {MANIFEST} is not a plain file of at most "
                          f"{manifest.MAX_MANIFEST_BYTES} bytes")
    try:
        with open(f, "rb", opener=_nofollow) as fh:
            m = json.loads(fh.read())
    except (ValueError, UnicodeDecodeError, RecursionError, OSError) as e:
        raise BadManifest(f"checkpoint {str(path)!r}: {MANIFEST} is not valid JSON ({str(e)[:80]})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise UserError(f"checkpoint {str(path)!r} is not a scaletrain sharded checkpoint ({FORMAT})")
    try:
        return manifest.check(m, path)
    except BadManifest as e:
        raise BadManifest(f"checkpoint {str(path)!r}: {MANIFEST}: {e}") from None


def _nofollow(name: str, flags: int) -> int:
    return os.open(name, flags | os.O_NOFOLLOW)


def _files_problem(path: Path, m: dict[str, Any]) -> str | None:
    """Why the manifest's files are not there as recorded: each a plain file (not a symlink) of its size."""
    for name, info in m["files"].items():
        try:
            st = (path / name).lstat()
        except OSError:
            return f"{name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is not a plain file (a symlink or special file is never read)"
        if st.st_size != info["bytes"]:
            return f"{name} has {st.st_size} bytes, the manifest says {info['bytes']}"
    return None


def problem(path: Path, crc_files: list[str] | None = None) -> str | None:
    """Why checkpoint ``path`` cannot be used (None: intact): its manifest (every field), every file's
    size, and the CRC32 of ``crc_files`` (None: every file; []: none — a CRC reads the whole file)."""
    try:
        m = read_manifest(path)
    except UserError as e:
        return str(e)
    why = _files_problem(path, m)
    if why:
        return why
    for name in (m["files"] if crc_files is None else crc_files):
        crc = 0
        with open(path / name, "rb", opener=_nofollow) as f:
            while chunk := f.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        if crc != m["files"][name]["crc32"]:
            return f"{name} fails its CRC32 check"
    return None


class LazyMap(Mapping):
    """A read-only mapping whose values are loaded when asked for (one tensor at a time), so a
    runtime taking only its shards never holds the whole state."""

    def __init__(self, keys: list[Any], load: Callable[[Any], Any]) -> None:
        self._keys, self._load = list(keys), load

    def __getitem__(self, k: Any) -> Any:
        if k not in self._keys:
            raise KeyError(k)
        return self._load(k)

    def __contains__(self, k: object) -> bool:
        return k in self._keys

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def materialize(obj: Any) -> Any:
    """Plain dicts (and lists) of loaded values, for runtimes that take whole state dicts."""
    if isinstance(obj, Mapping):
        return {k: materialize(obj[k]) for k in obj}
    if isinstance(obj, list):
        return [materialize(v) for v in obj]
    return obj


class Reader:
    """Reads the single-process tensors of a sharded checkpoint from its pieces."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest = read_manifest(path)
        why = _files_problem(path, self.manifest)
        if why:
            raise UserError(f"checkpoint {str(path)!r} is damaged: {why}")
        self.tensors: dict[str, Any] = self.manifest["tensors"]

    def read(self, key: str) -> torch.Tensor:
        """The whole canonical tensor ``key`` (its pieces read from their files)."""
        t = self.tensors[key]
        out = torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]))
        for p in t["pieces"]:
            with open(self.path / p["file"], "rb", opener=_nofollow) as f:
                f.seek(p["byte"])
                raw = f.read(p["nbytes"])
            if len(raw) != p["nbytes"]:
                raise UserError(f"checkpoint {str(self.path)!r}: {p['file']} is truncated")
            v = torch.frombuffer(bytearray(raw), dtype=getattr(torch, p["dtype"])).reshape(p["size"])
            if not p["size"]:
                out.copy_(v.reshape(()))
                continue
            box = tuple(slice(o, o + s) for o, s in zip(p["offset"], p["size"]))
            out[box] = v
        return out

    def keys(self, prefix: str) -> list[str]:
        return [k[len(prefix):] for k in self.tensors if k.startswith(prefix)]

    def model_state(self) -> LazyMap:
        """Like ``model.state_dict()`` (tied parameters under every name), loaded key by key."""
        aliases = self.manifest.get("aliases", {})
        names = self.keys("model/") + list(aliases)
        return LazyMap(names, lambda n: self.read("model/" + aliases.get(n, n)))

    def optimizer_state(self) -> dict[str, Any]:
        """The one-process optimizer's state dict (indices as its parameter numbering), lazily."""
        groups = self.manifest["param_groups"]
        order = [n for g in groups for n in g["params"]]
        states: dict[str, list[str]] = {}
        for k in self.keys("optim/"):
            name, _, what = k.rpartition("/")
            states.setdefault(name, []).append(what)
        objects = self.manifest.get("optim_objects", {})
        for k in objects:
            name, _, what = k.rpartition("/")
            states.setdefault(name, []).append(what)

        def one(name: str) -> LazyMap:
            def load(what: str) -> Any:
                key = f"{name}/{what}"
                return objects[key] if key in objects else self.read("optim/" + key)
            return LazyMap(sorted(states[name]), load)

        index = [i for i, n in enumerate(order) if n in states]
        param_groups, i = [], 0
        for g in groups:
            hyper = {k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k != "params"}
            param_groups.append({**hyper, "params": list(range(i, i + len(g["params"])))})
            i += len(g["params"])
        return {"state": LazyMap(index, lambda j: one(order[j])), "param_groups": param_groups}

    def rng(self, rank: int) -> dict[str, Any]:
        return {k: self.read(f"rng/{rank}/{k}") for k in self.keys(f"rng/{rank}/")}

    def state(self, lazy: bool) -> dict[str, Any]:
        """The trainer's checkpoint state (as :meth:`Trainer.state_dict` returns), model and optimizer
        loaded on access when ``lazy``. An imported checkpoint (``weights_only``) has the model only."""
        m = self.manifest
        try:
            manifest.check_resumable(m)
        except BadManifest as e:
            raise BadManifest(f"checkpoint {str(self.path)!r}: {MANIFEST}: {e}") from None
        if m.get("weights_only"):
            model = self.model_state()
            return {"step": int(m["step"]), "weights_only": True, "model": model if lazy else materialize(model)}
        world = int(m["world"])
        ranks = LazyMap(list(range(world)), self.rng)
        out = {"step": int(m["step"]), "model": self.model_state(), "optimizer": self.optimizer_state(),
               "scheduler": m["scheduler"], "scaler": m.get("scaler") or {}, "rng": self.rng(0),
               "rng_ranks": _LazyList(ranks) if world > 1 else None, "data": m.get("data", {}),
               "config": m.get("config", "")}
        if not lazy:
            out["model"], out["optimizer"] = materialize(out["model"]), materialize(out["optimizer"])
        return out


class _LazyList:
    """``rng_ranks``: every rank's RNG states, read only for the rank that asks."""

    def __init__(self, m: LazyMap) -> None:
        self._m = m

    def __len__(self) -> int:
        return len(self._m)

    def __bool__(self) -> bool:
        return len(self._m) > 0

    def __getitem__(self, i: int) -> Any:
        return self._m[i]
