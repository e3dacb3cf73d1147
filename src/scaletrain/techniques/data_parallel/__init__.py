"""Data parallelism, one family in one folder.

- :mod:`.launch` — torchrun's environment, process groups with timeouts, teardown, failures;
- :mod:`.ddp` — stage 0: torch DDP (bucketed all-reduce overlapped with backward);
- :mod:`.zero` — :class:`~.zero.GradSync`: stage 0 on model-parallel meshes and pipeline stages,
  stages 1-2 everywhere (ours: balanced row shards, bucketed reduce-scatter overlapped with backward);
- :mod:`.fsdp` — stage 3 (torch FSDP2 ``fully_shard`` per block, explicit prefetch), HSDP, and
  FSDP over the data-parallel dimension of a tensor-parallel mesh (2-D);
- :mod:`.sharded` — the row layout of shards;
- :mod:`.compression` — PowerSGD / top-k / 1-bit gradient compression (DDP comm hooks);
- :mod:`.cost` — ZeRO's per-rank model-state bytes and bytes communicated per step.
"""
