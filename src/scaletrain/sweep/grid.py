"""Which runs a sweep trains: a grid on the command line, or a runs file.

Grid: ``--grid optim.lr=1e-3,3e-3 model.overrides.n_layer=[4,8]`` is the Cartesian product of
the listed values (a key with one value is simply set for every run). A run is named after the
keys that vary (``lr=1e-3+n_layer=4``), which is also its directory under the sweep's.

Runs file (TOML)::

    [sweep]                 # SweepOptions: devices, policy, shards, device_budget, ...
    devices = 2
    [base]                  # config keys shared by every run (sections as in a config file)
    model.name = "gpt2-mini"
    [[run]]                 # one table per run: an optional name, then its config keys
    name = "small-lr"
    optim.lr = 1e-3

Every run's config is validated before anything starts (one line, exit 2, naming the run).
"""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.train.config import Config, _merge, from_dict, load_config, overrides_to_dict

_SAFE = re.compile(r"[^A-Za-z0-9._=+-]")


def parse_axis(spec: str) -> tuple[str, list[str]]:
    """``key=a,b,c`` or ``key=[a,b,c]`` -> (key, [value texts])."""
    if "=" not in spec:
        raise ConfigError(f"--grid {spec!r} is not of the form section.key=v1,v2,...")
    key, text = (s.strip() for s in spec.split("=", 1))
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    values = [v.strip() for v in text.split(",")]
    if not key or not values or any(v == "" for v in values):
        raise ConfigError(f"--grid {spec!r} has an empty key or value; write section.key=v1,v2,...")
    if len(set(values)) != len(values):
        raise ConfigError(f"--grid {spec!r} lists a value twice")
    return key, values


def expand(specs: list[str]) -> list[tuple[str, list[str]]]:
    """(run name, that run's ``key=value`` overrides) for every point of the grid."""
    axes = [parse_axis(s) for s in specs]
    keys = [k for k, _ in axes]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--grid names {sorted(k for k in keys if keys.count(k) > 1)[0]!r} twice")
    varying = [k for k, vs in axes if len(vs) > 1]
    out = []
    for combo in itertools.product(*(vs for _, vs in axes)):
        over = [f"{k}={v}" for k, v in zip(keys, combo)]
        label = "+".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, combo) if k in varying) or "run"
        out.append((_SAFE.sub("_", label), over))
    return out


def grid_runs(config: str | None, overrides: list[str], specs: list[str]) -> list[tuple[str, Config, dict]]:
    """(name, validated config, the run's own overrides) per grid point; ``overrides`` apply to all."""
    runs = []
    for name, over in expand(specs):
        try:
            cfg = load_config(config, list(overrides) + over)
        except ConfigError as e:
            raise ConfigError(f"run {name}: {e}") from None
        runs.append((name, cfg, dict(o.split("=", 1) for o in over)))
    return runs


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def file_runs(path: str, overrides: list[str]) -> tuple[dict[str, Any], list[tuple[str, Config, dict]]]:
    """([sweep] options, runs) of a runs file; command-line ``overrides`` apply to every run."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"runs file {path!r} does not exist") from None
    except OSError as e:  # a directory, unreadable
        raise ConfigError(f"runs file {path!r} cannot be read ({e.strerror}); give a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"runs file {path!r} is not valid UTF-8 TOML ({str(e).splitlines()[0]})") from None
    unknown = set(data) - {"sweep", "base", "run"}
    if unknown:
        raise ConfigError(f"runs file {path!r}: unknown table {sorted(unknown)[0]!r}; allowed: sweep, base, run")
    tables = data.get("run", [])
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"runs file {path!r} has no [[run]] tables; add one per run")
    runs, names = [], set()
    for i, table in enumerate(tables):
        table = dict(table)
        name = _SAFE.sub("_", str(table.pop("name", f"run{i}")))
        if name in names:
            raise ConfigError(f"runs file {path!r}: two runs are named {name!r}")
        names.add(name)
        try:
            cfg = from_dict(_merge(_merge(data.get("base", {}), table), overrides_to_dict(overrides)))
        except ConfigError as e:
            raise ConfigError(f"run {name}: {e}") from None
        runs.append((name, cfg, _flat(table)))
    return dict(data.get("sweep", {})), runs
