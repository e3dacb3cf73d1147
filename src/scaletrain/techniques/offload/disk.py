"""ZeRO-Infinity's disk tier: Adam states (and optionally fp32 master weights) in files on disk
(Rajbhandari et al. 2021, "ZeRO-Infinity", §5; the survey's §4.1).

Apply face — :class:`DiskStates`: per optimizer group, files ``m.bin`` and ``v.bin`` (and
``master.bin``) hold the flat fp32 tensors. They are memory-mapped; the update walks each group
in chunks of ``chunk_bytes`` through three host staging slots (the only host memory the tier
uses, counted in the host pool):

  read chunk k+1 (worker thread: ``madvise(WILLNEED)`` read-ahead, then a copy out of the
  mapping into a staging slot)  |  update chunk k (fused Adam kernel on the slot)  |
  write chunk k-1 (worker thread: ``os.pwrite`` of the slot into the file)

so disk reads, the CPU update and disk writes overlap. With masters on disk the updated
parameters are copied from the staging slot straight to the device. After each step the
written pages are synced and dropped from the page cache (``fdatasync`` +
``posix_fadvise(DONTNEED)``), so the states really live on the disk, not in RAM.

Safety: files live in a private directory ``<dir>/scaletrain-offload-<pid>-<random>/`` with an
``owner.json`` naming the process; it is removed by :meth:`close`, at garbage collection and at
interpreter exit; a directory left by a crashed process (its pid no longer alive) is removed the
next time a tier is opened in the same ``dir``. The size is checked before anything is written:
against ``max_bytes`` (``memory.offload.disk_max_bytes``) and the free space of the disk.
Files are zero-filled by ``ftruncate`` (sparse), which is Adam's initial state.

Cost face — :func:`predict_disk`: bytes read and written per step (8Ψ, or 12Ψ with masters) and
the time max(update, read/disk_read_bw + write/disk_write_bw), reads and writes sharing the disk.
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import shutil
import socket
import tempfile
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.errors import UserError
from scaletrain.techniques.offload.pools import Pools

PREFIX = "scaletrain-offload-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(directory: str | Path) -> list[Path]:
    """Remove tier directories under ``directory`` whose owning process on this host is gone."""
    removed = []
    root = Path(directory)
    if not root.is_dir():
        return removed
    host = socket.gethostname()
    for d in root.glob(PREFIX + "*"):
        try:
            owner = json.loads((d / "owner.json").read_text())
        except (OSError, ValueError):
            # No owner file: created and crashed before writing it, if older than a minute.
            if d.is_dir() and time.time() - d.stat().st_mtime > 60:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
            continue
        if owner.get("host") == host and not _pid_alive(int(owner.get("pid", -1))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class _LrHolder(torch.optim.Optimizer):
    """The param groups (and lr) a scheduler drives; the update itself is DiskStates.step."""

    def __init__(self, groups: list[dict]):
        super().__init__(groups, {})

    def step(self, closure=None):  # pragma: no cover - never called by the runtime
        raise RuntimeError("the disk tier is stepped by the offload runtime, not by optimizer.step()")


class _File:
    """One flat float32 tensor in a file: a mapping for reads, the descriptor for writes."""

    def __init__(self, path: Path, numel: int):
        self.path = path
        self.numel = numel
        self.nbytes = numel * 4
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, max(self.nbytes, 1))
        self.mm = mmap.mmap(self.fd, max(self.nbytes, 1))
        self.view = torch.frombuffer(self.mm, dtype=torch.float32, count=numel) if numel else torch.empty(0)

    def read_into(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        dst.copy_(self.view[lo:hi])

    def readahead(self, lo: int, hi: int) -> None:
        if hasattr(self.mm, "madvise") and hi > lo:
            page = mmap.PAGESIZE
            start = (lo * 4) // page * page
            self.mm.madvise(mmap.MADV_WILLNEED, start, hi * 4 - start)

    def write_from(self, src: torch.Tensor, lo: int) -> None:
        mv = memoryview(src.numpy()).cast("B")
        done = 0
        while done < len(mv):
            done += os.pwrite(self.fd, mv[done:], lo * 4 + done)

    def drop_cache(self) -> None:
        os.fdatasync(self.fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self.view = None
        try:
            self.mm.close()
        except BufferError:  # a view still exported; the mapping goes with the process
            pass
        os.close(self.fd)


def _remove(path: Path, files: list[_File]) -> None:
    for f in files:
        try:
            f.close()
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)


class DiskStates:
    """Adam/AdamW whose moments (and optionally masters) live in memory-mapped files."""

    def __init__(self, pools: Pools, directory: str | None = None, max_bytes: int | None = None,
                 chunk_bytes: int = 4 * 2**20, masters_on_disk: bool = False, drop_cache: bool = True):
        self.pools = pools
        self.root = Path(directory or tempfile.gettempdir())
        self.max_bytes = max_bytes
        self.chunk = max(int(chunk_bytes) // 4, 1024)
        self.masters_on_disk = masters_on_disk
        self.drop_cache = drop_cache
        self.path: Path | None = None
        self.files: list[dict[str, _File]] = []
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="scaletrain-disk")
        self.optimizer: torch.optim.Optimizer | None = None

    # -- setup --------------------------------------------------------------------------------
    def attach(self, flat_masters: list[torch.Tensor] | None, hparams: list[dict],
               device_params: list[list[torch.Tensor]] | None = None) -> None:
        """Create the files for groups of sizes given by ``flat_masters`` (or ``device_params``)."""
        sizes = ([int(f.numel()) for f in flat_masters] if flat_masters is not None
                 else [sum(p.numel() for p in ps) for ps in device_params])
        per = 3 if self.masters_on_disk else 2
        need = per * 4 * sum(sizes)
        if self.max_bytes is not None and need > self.max_bytes:
            raise UserError(f"disk tier needs {need} B for optimizer states, memory.offload.disk_max_bytes is "
                            f"{self.max_bytes} B; raise it or keep states on the host")
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"memory.offload.disk_dir={str(self.root)!r} is a file; name a directory (created if "
                            "missing) on the disk the optimizer states may use")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"memory.offload.disk_dir={str(self.root)!r} cannot be created ({e.strerror}); name a "
                            "writable directory") from None
        cleanup_stale(self.root)
        free = shutil.disk_usage(self.root).free
        if need > free:
            raise UserError(f"disk tier needs {need} B, only {free} B free in {str(self.root)!r}; "
                            "set memory.offload.disk_dir to a larger disk")
        self.path = self.root / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        (self.path / "owner.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                          "created": time.time()}))
        all_files: list[_File] = []
        for g, n in enumerate(sizes):
            d = {k: _File(self.path / f"group{g}.{k}.bin", n) for k in (["m", "v"] + (["master"] if per == 3 else []))}
            self.files.append(d)
            all_files += d.values()
        self._finalizer = weakref.finalize(self, _remove, self.path, all_files)
        atexit.register(self._finalizer)
        self.flat_masters = flat_masters
        self.device_params = device_params
        if self.masters_on_disk:
            for g, ps in enumerate(device_params):
                off = 0
                for p in ps:
                    n = p.numel()
                    host = p.detach().reshape(-1).to("cpu", torch.float32)
                    self.files[g]["master"].write_from(host, off)
                    off += n
        holders = flat_masters if flat_masters is not None else [ps[0] for ps in device_params]
        self.optimizer = _LrHolder([dict(params=[h], **hp) for h, hp in zip(holders, hparams)])
        self.steps = [0] * len(sizes)
        slot = min(self.chunk, max(sizes, default=0))  # a small model needs no full-size slots
        self._slots = [{k: self.pools.host.empty(slot, torch.float32) for k in self.files[0]} for _ in range(3)] \
            if sizes else []

    # -- the update ----------------------------------------------------------------------------
    def _read(self, g: int, slot: dict, lo: int, hi: int) -> None:
        for k, f in self.files[g].items():
            f.read_into(slot[k][: hi - lo], lo, hi)
        self.pools.stats.add("disk_read", "optimizer", len(self.files[g]) * (hi - lo) * 4)

    def _write(self, g: int, slot: dict, lo: int, hi: int) -> None:
        for k, f in self.files[g].items():
            f.write_from(slot[k][: hi - lo], lo)
        self.pools.stats.add("disk_write", "optimizer", len(self.files[g]) * (hi - lo) * 4)

    def _upload(self, g: int, master: torch.Tensor, lo: int, hi: int) -> None:
        """Copy updated master values [lo, hi) of group g to the device parameters they belong to."""
        off = 0
        for p in self.device_params[g]:
            n = p.numel()
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                self.pools.h2d_into(p.data.view(-1)[a - off:b - off], master[a - lo:b - lo], "params")
            off += n

    def step(self, flat_grads: list[torch.Tensor] | None, grad_bufs: list[torch.Tensor], has_all: bool = True,
             lrs: list[float] | None = None) -> None:
        """One Adam step over every group, chunk by chunk, reads/update/writes overlapped."""
        if not has_all:
            raise UserError("the disk tier needs a gradient for every trainable parameter each step "
                            "(freeze unused parameters with requires_grad=False)")
        for g, group in enumerate(self.optimizer.param_groups):
            n = self.files[g]["m"].numel
            if n == 0:
                continue
            self.steps[g] += 1
            step_t = torch.tensor(float(self.steps[g]))
            spans = [(lo, min(lo + self.chunk, n)) for lo in range(0, n, self.chunk)]
            reads: dict[int, Future] = {}
            writes: dict[int, Future] = {}

            def issue_read(k: int) -> None:
                if k < len(spans):
                    lo, hi = spans[k]
                    if k + 1 < len(spans):
                        for f in self.files[g].values():
                            f.readahead(*spans[k + 1])
                    prev = writes.pop(k % 3, None)  # the slot's last write must finish first
                    if prev is not None:
                        prev.result()
                    reads[k] = self._pool.submit(self._read, g, self._slots[k % 3], lo, hi)

            issue_read(0)
            for k, (lo, hi) in enumerate(spans):
                issue_read(k + 1)
                reads.pop(k).result()
                slot = self._slots[k % 3]
                m, v = slot["m"][: hi - lo], slot["v"][: hi - lo]
                master = slot["master"][: hi - lo] if self.masters_on_disk else self.flat_masters[g][lo:hi]
                b1, b2 = group["betas"]
                fn = torch._fused_adamw_ if group["adamw"] else torch._fused_adam_
                lr = float(group["lr"] if lrs is None else lrs[g])
                fn([master], [grad_bufs[g][lo:hi]], [m], [v], [], [step_t], lr=lr, beta1=b1, beta2=b2,
                   weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)
                if self.masters_on_disk:
                    self._upload(g, master, lo, hi)
                writes[k % 3] = self._pool.submit(self._write, g, slot, lo, hi)
            for f in writes.values():
                f.result()
            if self.drop_cache:
                for f in self.files[g].values():
                    f.drop_cache()

    # -- state ----------------------------------------------------------------------------------
    def state_tensors(self, g: int) -> dict[str, torch.Tensor]:
        """Copies of group g's files (for checkpoints and tests)."""
        return {k: f.view.clone() for k, f in self.files[g].items()}

    def load_state_tensors(self, g: int, tensors: dict[str, torch.Tensor], step: int) -> None:
        for k, t in tensors.items():
            self.files[g][k].write_from(t.reshape(-1).to(torch.float32).contiguous(), 0)
        self.steps[g] = int(step)

    @property
    def disk_bytes(self) -> int:
        return sum(f.nbytes for d in self.files for f in d.values())

    def close(self) -> None:
        """Remove the files (also done at exit and by the next tier opened after a crash)."""
        self._pool.shutdown(wait=True)
        self._slots = []
        if self.path is not None:
            self._finalizer()
            self.path = None


@dataclass
class DiskCost:
    disk_bytes: int
    read_bytes_per_step: int
    write_bytes_per_step: int
    host_staging_bytes: int
    time_s: float


def predict_disk(param_numel: int, platform, *, masters_on_disk: bool = False, chunk_bytes: int = 4 * 2**20,
                 n_groups: int = 1) -> DiskCost:
    """Cost face of :class:`DiskStates` for ``param_numel`` fp32 parameters (exact bytes)."""
    per = 3 if masters_on_disk else 2
    nbytes = per * 4 * param_numel
    chunk = min(max(int(chunk_bytes) // 4, 1024), param_numel)  # (one group: the largest possible)
    update = param_numel / platform.cpu_adam_params_per_s
    io = nbytes / platform.disk_read_bytes_per_s + nbytes / platform.disk_write_bytes_per_s
    return DiskCost(nbytes, nbytes, nbytes, 3 * per * chunk * 4 if n_groups else 0, max(update, io))
