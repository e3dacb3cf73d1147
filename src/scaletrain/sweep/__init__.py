"""Many models at once: ``scaletrain sweep`` (Hydra's shard alternator parallelism, Nagrecha & Kumar).

Several runs (a grid or a runs file) train together on devices that cannot hold one of their
models. Each model is cut along its Chain into shards that fit the device budget (:mod:`.shards`);
its fp32 parameters, gradients and optimizer states live on the host, as in ZeRO-Offload; a shard
is promoted to a device for its forward or backward and demoted after, its saved activations
spilled to host memory in between (:mod:`.worker`). A scheduler (:mod:`.policy`: Sharded-LRTF,
round robin, sequential, task parallel) hands ready shards of *different* models to free devices
(:mod:`.hub`), so every device stays busy where model parallelism idles all but one. Each run keeps
its own unchanged trainer (:mod:`.runtime` is its runtime), so its run directory, metrics and
checkpoints are a solo run's and its losses equal the solo run's bitwise on CPU.

Before training, every shard task is profiled on the devices and the whole sweep simulated
(:mod:`.predict`, :mod:`.simulate`): predicted makespan, utilisation and timeline next to the
measured ones (:mod:`.run`).
"""
