"""A sharded checkpoint's ``manifest.json`` is data, never paths: every field is checked before any
piece is read.

Why: a checkpoint may come from elsewhere (``checkpoint import``, a copied run). Its manifest
names the files to read and where each tensor's bytes are; trusted blindly, ``"file":
"/etc/passwd"`` or ``"../x"`` would load an outside file's bytes into the model, a shape of 10^12
would exhaust memory, a wrong dtype or a missing field would end in a traceback. So
:func:`check` accepts a manifest only when

- piece files are plain names of this checkpoint (``rank_NNNNN.bin``: no separator, no ``..``,
  never absolute), one per rank of ``world``, each with a size and a CRC32;
- every tensor key (and tied alias) is a name, not a path (:func:`check_key`), its dtype is one of
  :data:`DTYPES`, and its pieces are boxes inside its shape that cover it exactly once, each with
  ``nbytes = elements x element size`` inside its file, no two pieces of a file overlapping — so
  the bytes a reader allocates never exceed the files' recorded sizes;
- ``step`` (that of the directory's name) and ``world`` are sane integers, and the other fields
  have the types the reader expects.

A manifest that fails is a damaged checkpoint: the resume skips it with a warning as it does one
failing its CRC32, ``checkpoint info`` says DAMAGED, ``checkpoint export`` refuses it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
          "int8": 1, "uint8": 1, "bool": 1}
"""The dtypes a checkpoint may hold, with their element size in bytes."""
MAX_MANIFEST_BYTES = 1 << 30
MAX_STEP = 1 << 53
MAX_WORLD = 1 << 20
MAX_DIMS = 16
MAX_BYTES = 1 << 62
_FILE = re.compile(r"^rank_\d{5,7}\.bin$")
_STEP_DIR = re.compile(r"^step_(\d+)$")


class BadManifest(UserError):
    """A manifest that fails :func:`check` (the checkpoint counts as damaged)."""


def check_key(name: Any, what: str = "tensor name") -> str:
    """``name`` if it is a name and not a path: a non-empty string without control characters or
    backslashes, not absolute, with no empty, ``.`` or ``..`` component between slashes."""
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise BadManifest(f"{what} {str(name)[:80]!r} is not a non-empty string of at most 1024 characters")
    if name.startswith("/") or "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise BadManifest(f"{what} {name[:80]!r} looks like a path (absolute, backslash or control character); "
                          f"names are like 'h.0.attn.c_attn.weight'")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise BadManifest(f"{what} {name[:80]!r} has an empty, '.' or '..' component; names are not paths")
    return name


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise BadManifest(f"{what} is {str(v)[:40]!r}; must be an integer in {lo}..{hi}")
    return v


def _ints(v: Any, n: int | None, what: str) -> list[int]:
    if not isinstance(v, list) or (n is not None and len(v) != n) or len(v) > MAX_DIMS:
        raise BadManifest(f"{what} is {str(v)[:60]!r}; must be a list of {n if n is not None else '<= 16'} integers")
    return [_int(x, 0, MAX_BYTES, what) for x in v]


def _dict(m: dict, key: str, required: bool = True) -> dict:
    v = m.get(key, None if required else {})
    if not isinstance(v, dict):
        raise BadManifest(f"field {key!r} is {'missing' if v is None else type(v).__name__}; must be an object")
    return v


def _jsonish(v: Any, what: str, depth: int = 0) -> None:
    """Plain JSON values (what state dicts of schedulers, scalers and optimizers hold)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return
    if depth < 8 and isinstance(v, list):
        for x in v:
            _jsonish(x, what, depth + 1)
        return
    if depth < 8 and isinstance(v, dict):
        for k, x in v.items():
            _jsonish(x, what, depth + 1)
        return
    raise BadManifest(f"{what} holds {type(v).__name__} nested too deep")


def _disjoint(boxes: list[tuple[list[int], list[int]]]) -> bool:
    """True when no two boxes (offset, size) overlap (swept along dim 0)."""
    boxes = sorted((b for b in boxes if all(b[1])), key=lambda b: b[0][0] if b[0] else 0)
    for i, (off, size) in enumerate(boxes):
        for off2, size2 in boxes[i + 1:]:
            if off and off2[0] >= off[0] + size[0]:
                break
            if all(o2 < o + s and o < o2 + s2 for o, s, o2, s2 in zip(off, size, off2, size2)):
                return False
    return True


def _tensor(key: str, t: Any, files: dict[str, dict]) -> list[tuple[str, int, int]]:
    """Check tensor ``key``'s entry; returns its pieces' (file, byte, nbytes)."""
    if not isinstance(t, dict) or not isinstance(t.get("pieces"), list):
        raise BadManifest(f"tensor {key!r} has no list of pieces")
    if not isinstance(t.get("dtype"), str) or t["dtype"] not in DTYPES:
        raise BadManifest(f"tensor {key!r} has dtype {str(t.get('dtype'))[:40]!r}; allowed: {', '.join(DTYPES)}")
    shape = _ints(t.get("shape"), None, f"tensor {key!r} shape")
    spans, boxes, elements = [], [], 0
    for p in t["pieces"]:
        if not isinstance(p, dict) or not isinstance(p.get("file"), str) or p["file"] not in files:
            raise BadManifest(f"a piece of tensor {key!r} names a file not listed in 'files'")
        if not isinstance(p.get("dtype"), str) or p["dtype"] not in DTYPES:
            raise BadManifest(f"a piece of tensor {key!r} has dtype {str(p.get('dtype'))[:40]!r}; allowed: "
                              f"{', '.join(DTYPES)}")
        off = _ints(p.get("offset"), len(shape), f"a piece offset of tensor {key!r}")
        size = _ints(p.get("size"), len(shape), f"a piece size of tensor {key!r}")
        if any(o + s > d for o, s, d in zip(off, size, shape)):
            raise BadManifest(f"a piece of tensor {key!r} at {off} of size {size} lies outside its shape {shape}")
        n = math.prod(size)
        nbytes = _int(p.get("nbytes"), 0, MAX_BYTES, f"a piece nbytes of tensor {key!r}")
        if nbytes != n * DTYPES[p["dtype"]]:
            raise BadManifest(f"a piece of tensor {key!r} has {nbytes} bytes for {n} {p['dtype']} elements")
        byte = _int(p.get("byte"), 0, MAX_BYTES, f"a piece byte offset of tensor {key!r}")
        if byte + nbytes > files[p["file"]]["bytes"]:
            raise BadManifest(f"a piece of tensor {key!r} ends at byte {byte + nbytes}, past the end of {p['file']} "
                              f"({files[p['file']]['bytes']} bytes)")
        elements += n
        spans.append((p["file"], byte, nbytes))
        boxes.append((off, size))
    if elements != math.prod(shape) or not _disjoint(boxes):
        raise BadManifest(f"the pieces of tensor {key!r} do not cover its shape {shape} exactly once")
    return spans


def check(m: dict[str, Any], path: Path) -> dict[str, Any]:
    """``m`` if it is a sound manifest of checkpoint directory ``path`` (see the module docstring),
    else :class:`BadManifest` naming the first field that is not."""
    step = _int(m.get("step"), 0, MAX_STEP, "step")
    named = _STEP_DIR.match(path.name)
    if named and int(named.group(1)) != step:
        raise BadManifest(f"step is {step} but the directory is {path.name}")
    world = _int(m.get("world"), 1, MAX_WORLD, "world")
    files = _dict(m, "files")
    if len(files) != world:
        raise BadManifest(f"'files' lists {len(files)} file(s) for world {world} (one per rank)")
    for name, info in files.items():
        if not _FILE.match(name):
            raise BadManifest(f"file {name[:80]!r} is not a rank file name (rank_NNNNN.bin); piece files are names "
                              f"inside the checkpoint, never paths")
        if not isinstance(info, dict):
            raise BadManifest(f"file {name!r} has no size and CRC32")
        _int(info.get("bytes"), 0, MAX_BYTES, f"file {name!r} bytes")
        _int(info.get("crc32"), 0, 2**32 - 1, f"file {name!r} crc32")
    spans: dict[str, list[tuple[int, int]]] = {}
    for key, t in _dict(m, "tensors").items():
        for f, byte, nbytes in _tensor(check_key(key, "tensor key"), t, files):
            spans.setdefault(f, []).append((byte, nbytes))
    for f, s in spans.items():
        s.sort()
        if any(b0 + n0 > b1 for (b0, n0), (b1, _) in zip(s, s[1:])):
            raise BadManifest(f"pieces overlap in {f}")
    tensors = m["tensors"]
    for alias, target in _dict(m, "aliases", required=False).items():
        check_key(alias, "alias")
        if not isinstance(target, str) or "model/" + target not in tensors:
            raise BadManifest(f"alias {alias!r} names {str(target)[:80]!r}, which is not a model tensor")
    if not isinstance(m.get("weights_only", False), bool):
        raise BadManifest("weights_only is not true or false")
    for key in ("plan", "data", "scaler", "optim_objects"):
        _jsonish(_dict(m, key, required=False), f"field {key!r}")
    if not isinstance(m.get("config", ""), str) or not isinstance(m.get("layout", ""), str):
        raise BadManifest("config or layout is not a string")
    _jsonish(_dict(m, "scheduler", required=False), "field 'scheduler'")
    groups = m.get("param_groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise BadManifest("param_groups is not a list of groups with 'params' lists")
    for g in groups:
        _jsonish({k: v for k, v in g.items() if k != "params"}, "a param group")
        for n in g["params"]:
            check_key(n, "parameter name")
    return m


def check_resumable(m: dict[str, Any]) -> None:
    """A checked manifest that a training run can resume from: imported weights, or the full
    training state (scheduler, optimizer groups, every rank's RNG state)."""
    if m.get("weights_only"):
        return
    for key in ("scheduler", "param_groups"):
        if key not in m:
            raise BadManifest(f"field {key!r} is missing (a training checkpoint has it)")
    missing = [r for r in range(m["world"]) if f"rng/{r}/torch" not in m["tensors"]]
    if missing:
        raise BadManifest(f"no RNG state of rank {missing[0]} (rng/{missing[0]}/torch)")
