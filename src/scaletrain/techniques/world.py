"""The job's one device mesh: named dimensions ``(pp, dp_rep, dp_in, cp, tp)``, built once per process.

Why one: every runtime used to build its own mesh (the SPMD runtime a ``(dp_rep, dp_in, cp, tp)`` one,
the pipeline a ``(dp, pp, tp)`` one for TP and a ``(pp, dp)`` one for ZeRO-3, plus ranks lists turned
into groups by hand), so each combination of techniques was laid out twice and could disagree. Here
the layout is one formula and every group is a slice of one mesh (torchtitan's ``ParallelDims``).

Dimensions, outermost first (global rank = ``(((p·R + a)·I + i)·C + c)·T + t``):

- ``pp``: pipeline rank (1 without pipelines);
- ``dp_rep`` x ``dp_in``: the data-parallel replicas, ``dp = dp_rep · dp_in``. The inner one is the
  expert-parallel group (``parallel.ep``: each rank its own tokens and E/ep experts) or HSDP's shard
  group (``parallel.hsdp``); else it is 1. ZeRO / FSDP shard over the flattened ``dp`` (or ``dp x cp``);
- ``cp``: ranks sharing a batch and splitting its sequence (ring attention);
- ``tp``: tensor parallelism, innermost so a TP group is neighbours (Megatron's placement).

With ``tp = cp = 1`` pipeline rank ``r`` of replica ``d`` is global rank ``r·dp + d``: the pipeline
runtime's ``ranks[r·dp + d]`` order. Groups a mesh cannot name (holders of a tied weight, Chimera's
stage pairs) stay with the pipeline (:func:`.pipeline.p2p.group`), which first learns every group
of this mesh (:func:`share_groups`) so that no group is created twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scaletrain.errors import UserError

DIMS = ("pp", "dp_rep", "dp_in", "cp", "tp")
FLAT = {"dp": ("dp_rep", "dp_in"), "dp_cp": ("dp_rep", "dp_in", "cp"), "edp_cp": ("dp_rep", "cp"),
        "pipe": ("pp", "dp_rep", "dp_in")}
"""Flattened views: all data-parallel ranks; the ranks averaging replicated gradients (dp x cp); the
ranks holding the same experts (dp_rep x cp); one TP index's whole pipeline (pp x dp)."""


@dataclass(frozen=True)
class Dims:
    """Sizes of the world mesh's dimensions (processes)."""

    pp: int = 1
    dp_rep: int = 1
    dp_in: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_rep * self.dp_in

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @classmethod
    def of(cls, *, world: int, pp: int = 1, tp: int = 1, cp: int = 1, inner: int = 1, what: str = "") -> Dims:
        """The sizes for ``world`` processes: dp is what pp x cp x tp leave; ``inner`` (the EP or HSDP
        group, named ``what`` in errors) must divide it."""
        pp_x = f"parallel.pp={pp} x " if pp > 1 else ""
        if world % (pp * tp * cp):
            raise UserError(f"{pp_x}parallel.tp={tp} x parallel.cp={cp} must divide the {world} processes")
        dp = world // (pp * tp * cp)
        if dp % inner:
            raise UserError(f"{what} must divide the data-parallel size {dp} (= {world} processes / "
                            f"({'pp x ' if pp > 1 else ''}tp x cp))")
        return cls(pp, dp // inner, inner, cp, tp)


class World:
    """The job's mesh and its named slices (every process holds the same one)."""

    def __init__(self, mesh: DeviceMesh, dims: Dims):
        self.mesh, self.dims = mesh, dims
        self._flat: dict[str, DeviceMesh] = {}

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh by dimension name(s), or a flattened view by its :data:`FLAT` name."""
        if isinstance(names, str) and names in FLAT:
            if names not in self._flat:
                self._flat[names] = self.mesh[FLAT[names]]._flatten(names)
            return self._flat[names]
        return self.mesh[names]

    def group(self, name: str) -> Any:
        """This rank's process group along ``name`` (a dimension or a flattened view)."""
        return self[name].get_group()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()


_WORLD: dict[tuple, tuple[Any, World]] = {}
"""(device type, dims) -> (the default process group it was built on, the mesh): a mesh of a destroyed
group is never handed out (the group object is kept, so its identity cannot be reused)."""


def world_mesh(dims: Dims, device_type: str = "cpu") -> World:
    """The world mesh of ``dims`` over the initialised process group, built once per process and group
    (collective over the world the first time: every process must ask for the same dims in the same order;
    so is each flattened view, created on first use)."""
    if dims.world != dist.get_world_size():
        raise UserError(f"the mesh {dims} needs {dims.world} processes; the job has {dist.get_world_size()}")
    key = (device_type, dims)
    if key not in _WORLD or _WORLD[key][0] is not dist.group.WORLD:
        sizes = tuple(getattr(dims, d) for d in DIMS)
        _WORLD[key] = (dist.group.WORLD, World(init_device_mesh(device_type, sizes, mesh_dim_names=DIMS), dims))
    return _WORLD[key][1]


def rank_groups(dims: Dims) -> dict[str, list[tuple[int, ...]]]:
    """Every group of each dimension and flattened view of size > 1 (sorted global ranks), by name."""
    import torch

    grid = torch.arange(dims.world).reshape([getattr(dims, d) for d in DIMS])
    out: dict[str, list[tuple[int, ...]]] = {}
    for name, names in [(d, (d,)) for d in DIMS] + list(FLAT.items()):
        axes = [DIMS.index(d) for d in names]
        rest = [a for a in range(len(DIMS)) if a not in axes]
        size = 1
        for a in axes:
            size *= grid.shape[a]
        if size > 1:
            out[name] = [tuple(sorted(row)) for row in grid.permute(*rest, *axes).reshape(-1, size).tolist()]
    return out


def all_groups(world: World) -> dict[tuple[int, ...], Any]:
    """Every group of the mesh's dimensions and views of size > 1, by its sorted global ranks: this
    process's own group object, ``GroupMember.NON_GROUP_MEMBER`` for the others (as ``new_group``
    returns them). Creates the flattened views (collective)."""
    me = dist.get_rank()
    out: dict[tuple[int, ...], Any] = {}
    for name, groups in rank_groups(world.dims).items():
        mine = world.group(name)
        out.update({g: mine if me in g else dist.GroupMember.NON_GROUP_MEMBER for g in groups})
    return out
