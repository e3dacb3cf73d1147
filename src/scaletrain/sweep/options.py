"""How a sweep runs (not what each run trains): one schema for the CLI flags and a runs file's ``[sweep]``."""

from __future__ import annotations

from dataclasses import dataclass, fields

from scaletrain.errors import ConfigError
from scaletrain.sweep.policy import POLICIES
from scaletrain.train.config import Config, opt


@dataclass
class SweepOptions:
    devices: int = opt(2, "logical devices (worker processes here; one per GPU elsewhere) the runs' shards share",
                       "devices", min=1)
    policy: str = opt("auto", "which ready shard runs next: lrtf (Hydra's Sharded-LRTF: longest remaining time "
                              "first), round_robin, sequential (one run at a time: model parallelism), task (each "
                              "run on one device: task parallelism); auto = the one the simulator predicts fastest",
                      choices=("auto", *POLICIES))
    shards: int = opt(0, "shards per model; 0 = the fewest whose predicted peak fits memory.device_budget", "shards",
                      min=0)
    device_budget: str = opt("", "bytes each device may hold (e.g. '24MiB'); empty = the runs' memory.device_budget",
                             "bytes")
    cores: int = opt(0, "host cores shared by the devices and the host optimizer steps; 0 = this machine's", "cores",
                     min=0)
    threads: int = opt(0, "compute threads per device; 0 = cores / devices", "threads", min=0)
    track_memory: bool = opt(True, "count every device byte against the budget (a CPU device fails at the allocation "
                                   "that crosses it, as a GPU would); off only for timing")
    repeats: int = opt(2, "profile repeats of each shard task before the sweep (the simulator's durations)", "runs",
                       min=1)

    def budget_bytes(self, cfg: Config) -> int | None:
        from scaletrain.techniques.remat.schedule import parse_bytes

        text = self.device_budget or cfg.memory.device_budget
        try:
            return parse_bytes(text) if text else None
        except (ValueError, TypeError):
            raise ConfigError(f"device budget {text!r} is not a size; use bytes or e.g. '24MiB'") from None


def describe_options() -> list[tuple[str, str]]:
    """(flag, help) of every option, for the CLI's help."""
    return [(f.name, f.metadata["help"]) for f in fields(SweepOptions)]
