"""Data parallelism, one family in one folder.

- :mod:`.launch` — torchrun's environment, process groups with timeouts, teardown, failures;
- :mod:`.ddp` — stage 0: torch DDP (bucketed all-reduce overlapped with backward);
- :mod:`.sharded` / :mod:`.zero` — stages 1-2 (ours: balanced row shards, reduce-scatter buckets);
- :mod:`.fsdp` — stage 3 (torch FSDP2 ``fully_shard`` per block, explicit prefetch), HSDP;
- :mod:`.compression` — PowerSGD / top-k / 1-bit gradient compression (DDP comm hooks);
- :mod:`.cost` — ZeRO's per-rank model-state bytes and bytes communicated per step.
"""
