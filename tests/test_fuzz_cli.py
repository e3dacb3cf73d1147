"""Fuzz `scaletrain train` with generated configs: exit 0 or 2, never a traceback, no run
directory unless training started.

In-process (``scaletrain.cli.main``, SystemExit caught, stderr captured): hundreds of cases in
seconds. Every case trains at most one step of a tiny model; the generator is seeded, so a
failure names a case that reproduces (``CASES[i]``). ``FUZZ_CASES=2000 FUZZ_SEED=7`` runs a longer hunt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from typing import get_type_hints

import pytest

from scaletrain.cli import main
from scaletrain.train.config import Config

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads only add contention

BASE = ["model.overrides={n_layer=1, n_embd=32, n_head=2}", "data.seq_len=16", "data.name=synthetic-text",
        "train.global_batch=2", "train.eval_every=0", "train.eval_batches=1", "train.steps=1", "train.progress=off",
        "optim.warmup_steps=0", "data.num_samples=64"]
SMALL_MODELS = ["gpt2-tiny", "gpt2-mini", "resnet-mini", "vgg-mini", "mlp", "gpt2-moe", "dlrm-mini", "gpt9", '""']
POOLS = {
    int: ["-1", "0", "1", "2", "3", "1.5", '"x"', "true", "[1]", "{a=1}", "nan", "99999999999999999999", "2e9"],
    float: ["-1.0", "0", "1e-9", "0.5", "2", "1e30", "nan", "inf", '"x"', "true", "[]"],
    str: ['"x"', "none", "all", '"1,2"', '""', "1KiB", "-3", '"0,99"', "1e40GiB", '"-1MiB"', "[1]", "{a=1}"],
    bool: ["true", "false", "1", '"yes"', "[]"],
    dict: ["{}", "1", '"x"', "{bogus=1}", "{n_layer=0}", "{n_layer=-1}", "{n_head=3}", "{beta1=[1,2]}",
           "{fused=1}", "{vocab_size=0}"],
}
GUARDED = {"train.steps": ["0", "-1", '"x"', "1.5", "2"], "data.image_size": ["0", "-1", "4", "7", "1.5", '"x"'],
           "train.global_batch": ["0", "-1", "1", "3", "4", '"x"'], "data.num_samples": ["0", "-1", "1", "5", "x"],
           "train.eval_batches": ["0", "1", "3", '"x"'], "train.micro_batch": ["-1", "0", "1", "3", '"x"']}
"""Keys whose large valid values would make a case slow: only small or invalid ones."""
GARBAGE_KEYS = ["foo.bar=1", "train.stepz=3", "model=3", "a.b.c.d=1", "train=1", ".x=1", "train.=1", "=1",
                "noequals", "memory.remat=1", "parallel.pp.x=1", "model.overrides.bogus=1"]
FILES = [b"\xff\xfe\x00garbage", b"[train]\nsteps = 'x'\n", b"train = 3\n", b"[train\n", b"", b"[[train]]\nsteps=1\n",
         b"[model]\nname = 'gpt2-xl'\n[model.overrides]\nn_layer = 0\n", b"[parallel]\npp = 2\n",
         "[train]\nsteps = 1\n# \u2603 \u00e9\n".encode(), b"[optim]\nname = 'sgd'\n[optim.options]\nnesterov = 'x'\n"]


def _fields() -> dict[str, tuple[type, list[str]]]:
    """Every config key: its Python type and its closed set of values (as TOML strings), if any."""
    out: dict[str, tuple[type, list[str]]] = {}

    def walk(obj: object, prefix: str) -> None:
        hints = get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            if f.metadata.get("section"):
                walk(getattr(obj, f.name), f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = (hints[f.name], [f'"{c}"' for c in f.metadata.get("choices") or ()])
    walk(Config(), "")
    return out


def _cases(n: int, seed: int = 16) -> list[dict]:
    rng = random.Random(seed)
    fields = _fields()
    cases = []
    for i in range(n):
        over: list[str] = []
        kind = rng.random()
        for _ in range(rng.randint(1, 4)):
            key = rng.choice(list(fields))
            typ, closed = fields[key]
            pool = GUARDED.get(key) or closed * 3 + POOLS[typ]  # valid choices thrice as often
            over.append(f"{key}={rng.choice(pool)}")
        if kind < 0.15:
            over.append(rng.choice(GARBAGE_KEYS))
        if kind > 0.85:
            name = rng.choice(SMALL_MODELS)
            over += [f"model.name={name}", "model.overrides={}", "data.name=" + ("" if rng.random() < 0.5 else
                                                                                  rng.choice(['"digits"', "shakespeare",
                                                                                              "synthetic-images"]))]
        case = {"over": over, "file": rng.choice(FILES) if rng.random() < 0.12 else None,
                "plan": rng.choice(FILES) if rng.random() < 0.05 else None}
        cases.append(case)
    return cases


CASES = _cases(int(os.environ.get("FUZZ_CASES", "500")), int(os.environ.get("FUZZ_SEED", "16")))


def _run(tmp: Path, i: int, case: dict, capsys) -> tuple[int, str, Path]:
    out = tmp / f"run{i}"
    argv = ["train", "--out", str(out)]
    if case["file"] is not None:
        (tmp / f"c{i}.toml").write_bytes(case["file"])
        argv += ["--config", str(tmp / f"c{i}.toml")]
    if case["plan"] is not None:
        (tmp / f"p{i}.toml").write_bytes(case["plan"])
        argv += ["--plan", str(tmp / f"p{i}.toml")]
    argv += BASE + case["over"]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().err, out


def _trained(out: Path) -> bool:
    """Training started: the run directory holds at least one training row."""
    m = out / "metrics.jsonl"
    return m.is_file() and any("loss" in json.loads(line) for line in m.read_text().splitlines() if line.strip())


def test_generated_configs_exit_0_or_2_without_traceback_or_stray_run_dir(tmp_path, capsys):
    bad = []
    for i, case in enumerate(CASES):
        try:
            rc, err, out = _run(tmp_path, i, case, capsys)
        except Exception as e:  # noqa: BLE001 - a traceback: what this test hunts
            bad.append(f"CASES[{i}] {case['over']} file={case['file']!r}: {type(e).__name__}: {e}"[:400])
            continue
        if rc not in (0, 2) or "Traceback" in err:
            bad.append(f"CASES[{i}] {case['over']}: rc {rc}: {err[-300:]}")
        elif rc == 2 and out.exists() and not _trained(out):
            bad.append(f"CASES[{i}] {case['over']}: failed before training but left {out}")
        elif rc == 2 and len([x for x in err.splitlines() if x.startswith(("scaletrain: error:",
                                                                            "scaletrain train: error:"))]) != 1:
            bad.append(f"CASES[{i}] {case['over']}: not one line: {err[-300:]}")
    assert not bad, "\n".join(bad[:15]) + f"\n({len(bad)} of {len(CASES)} cases)"
