"""Fuzz every command but `train` (tests/test_fuzz_cli.py fuzzes its configs) with generated argv: exit 0 or 2,
never a traceback, an error as exactly one line, and nothing written by a case that failed.

In-process (``scaletrain.cli.main``, SystemExit caught), seeded (a failure names ``CASES[i]``, which reproduces).
Each command has a cheap valid base and pools of values per option, most of them wrong (negative, zero, NaN,
huge, text, missing files, directories where files go, non-UTF-8 files, hostile platform files): the wrong ones
end at argparse or at the first check, the few valid ones predict a one-layer model. ``FUZZ_CMD_CASES=20000``
runs a longer hunt.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import pytest

from scaletrain.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

INT = ["-1", "0", "1", "2", "3", "x", "1.5", "nan", "99999999999999999999", ""]
FLOAT = ["-1", "0", "1e-9", "2.5", "nan", "inf", "-inf", "x", "1e400", "1e12"]
SIZE = ["1MiB", "0", "-1", "x", "1e40GiB", "nan", ""]
FILES = {"plat_str.json": b'{"name": "x", "flops_fp32": "fast"}', "plat_zero.json": b'{"name": "x", "flops_bf16": 0}',
         "plat_neg.json": b'{"name": "x", "device_memory_bytes": -5}', "plat_nan.json": b'{"name": "x", "h2d_bytes_per_s": NaN}',
         "plat_list.json": b"[1, 2]", "plat_ok.json": b'{"name": "ok", "device_type": "cuda", "flops_bf16": 1e14, '
                                                       b'"intra_node_bytes_per_s": 1e11, "devices_per_node": 8}',
         "plat_bool.json": b'{"name": "x", "copy_overlaps_compute": 1}', "plat_eff.json": b'{"name": "x", "mem_efficiency": [[1, 2]]}',
         "bin.json": b"\xff\xfe\x00garbage", "empty.toml": b"", "bad.toml": b"[train\n", "runs.toml": b"[[run]]\nbogus = 1\n",
         "plan.toml": b"[parallel]\npp = 0\n", "profile.json": b'{"blocks": 3}', "notes.txt": b"to be or not to be\n",
         "latin1.txt": b"caf\xe9\n", "rows.jsonl": b'{"text": "a b"}\n{"body": 1}\n', "empty.txt": b""}
PATHS = ["adir", "afile", "nope/missing.json", "/proc/nope/x", "bin.json", "empty.toml"]
OUTS = ["adir", "afile", "/proc/nope/out", "new/x.toml", "/proc/x.png"]
PLATS = ["h100", "a100-40g", "nope", "local", *[k for k in FILES if k.startswith("plat_")], "nope.json", "bin.json"]
MODELS = ["gpt2-tiny", "gpt9", "hf:nope", "py:no_mod:f", "hf:/nope/dir", "mlp", ""]
SETS = ["n_layer=-1", "n_layer=0", "n_layer=nan", "n_embd=0", "n_head=3", "bogus=1", "noequals", "n_layer=99999999999999999999",
        "dropout=nan", "n_layer=2"]

COMMANDS: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "estimate": (["--model", "gpt2-tiny", "--set", "n_layer=1", "--seq", "16", "--platform", "h100"],
                 {"--batch": INT, "--seq": INT, "--accum": INT, "--precision": ["fp16", "x"], "--optimizer": ["sgd", "x"],
                  "--params-dtype": ["bf16", "int8"], "--set": SETS, "--flops-per-s": FLOAT, "--dp": INT, "--zero": INT,
                  "--hsdp": INT, "--tp": INT, "--cp": INT, "--ep": INT, "--pp": INT, "--schedule": ["zb1p", "x"],
                  "--microbatches": INT, "--virtual": INT, "--remat": ["periodic", "x"], "--remat-budget": SIZE,
                  "--global-batch": INT, "--platform": PLATS, "--model": MODELS, "--plan": PATHS + ["plan.toml"],
                  "--device": ["cuda", "tpu"], "--bogus": [""]}),
    "plan": (["--model", "gpt2-small", "--global-batch", "8", "--gpus-per-node", "2", "--set", "n_layer=2"],
             {"--nodes": ["0", "1-3", "3-1", "x", "1,,2", "1-10000000", "-2", "2"], "--gpus-per-node": INT,
              "--global-batch": INT, "--seq": INT, "--fix": ["tp=2", "tp=x", "bogus=1", "zero=9", "noequals"],
              "--precision": ["fp16", "x"], "--optimizer": ["x", "sgd"], "--tokens": FLOAT, "--samples": FLOAT,
              "--objective": ["cost", "x"], "--price": ["h100=3", "h100=-1", "x", "a100-80g=nan"],
              "--deadline": ["1h", "-1", "x", "0"], "--max-cost": FLOAT, "--top": INT, "--explain": INT,
              "--platform": PLATS, "--out": OUTS, "--timeline": OUTS + ["t.txt"], "--set": SETS, "--model": MODELS}),
    "compat": ([], {"--nproc": INT, "--config": PATHS + ["bad.toml"], "--plan": PATHS + ["plan.toml"],
                    "parallel.pp=": INT, "parallel.tp=": INT, "train.steps=": INT, "memory.remat.method=": ["x", "dtr"],
                    "model.name=": MODELS, "bogus=": ["1"], "--markdown": [""], "--json": [""]}),
    "pipeline": ([], {"--schedule": ["interleaved", "chimera", "pipedream-2bw", "x"], "--ranks": INT + ["4096", "100000"],
                      "--microbatches": INT + ["100000", "65536"], "--virtual": INT, "--steps": INT + ["65"],
                      "--profile": PATHS + ["profile.json"], "--model": MODELS[1:], "--batch": INT, "--seq": INT,
                      "--bandwidth-gbps": FLOAT, "--latency-us": FLOAT, "--memory-limit-gib": FLOAT,
                      "--bytes-per-param": FLOAT, "--png": OUTS, "--equal-split": [""]}),
    "remat": (["--model", "gpt2-tiny", "--seq", "8", "--budget", "64MiB", "--methods", "none", "periodic",
               "--time-limit", "1"],
              {"--batch": INT, "--seq": INT, "--budget": SIZE, "--methods": ["x", "dtr"], "--precision": ["x", "bf16"],
               "--time-limit": FLOAT, "--repeats": INT, "--intra-block": INT + ["-5", "99"], "--model": MODELS}),
    "profile": (["--model", "gpt2-tiny", "--set", "n_layer=1", "--seq", "8", "--repeats", "1", "--warmup", "0"],
                {"--batch": INT, "--seq": INT, "--accum": INT, "--repeats": INT, "--warmup": INT, "--device": ["tpu", "x"],
                 "--set": SETS, "--precision": ["x"], "--model": MODELS}),
    "sweep": (["--predict-only"], {"--grid": ["train.steps=0", "optim.lr=x,y", "bogus.key=1", "noequals", "train.steps="],
                                   "--runs": PATHS + ["runs.toml", "bad.toml"], "--config": PATHS, "--devices": INT + ["1000"],
                                   "--policy": ["x", "lrtf"], "--shards": INT, "--device-budget": SIZE, "--cores": INT,
                                   "--threads": INT, "--resume": [""], "--out": OUTS}),
    "compare": (["--models", "nope"], {"--repeats": INT, "--steps": INT, "--devices": ["0", "x", "1,-2"],
                                       "--strategies": ["x", "ddp"], "--out": OUTS, "--quick": [""]}),
    "calibrate": (["--model", "nope"], {"--nproc-per-node": INT + ["1000"], "--precision": ["x"], "--timeout": FLOAT,
                                        "--out": OUTS}),
    "checkpoint info": (["RUN"], {"--json": [""], "--no-verify": [""], "RUN": ["adir", "afile", "nope", "bin.json"]}),
    "checkpoint export": (["RUN"], {"--to": ["hf", "x"], "--out": OUTS + ["adir/new.safetensors"],
                                    "RUN": ["adir", "afile", "nope"]}),
    "checkpoint import": (["bin.json"], {"--out": OUTS + ["RUN", "newrun"], "FILE": PATHS}),
    "models": ([], {"--json": [""], "--bogus": [""]}),
    "optimizers": ([], {"--json": [""], "x": [""]}),
}
"""Per command: a cheap base argv (RUN: a trained run directory) and option -> value pools."""


LATER: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "data prepare": (["FILE", "--progress", "off"],
                     {"FILE": ["notes.txt", "latin1.txt", "rows.jsonl", "empty.txt", "adir", "nope/*.txt", "bin.json"],
                      "--out": OUTS + ["newtok"], "--tokenizer": PATHS + ["adir"], "--field": ["text", "body", ""],
                      "--progress": ["x", "on"], "--json": [""]}),
    "remat": (["--model", "gpt2-tiny", "--seq", "8", "--budget", "64MiB", "--methods", "none", "--time-limit", "1"],
              {"--threads": INT, "--repeats": INT, "--measure": [""]}),
    "calibrate": (["--model", "nope", "--compile"], {"--nproc-per-node": INT, "--out": OUTS}),
}
"""Commands and flags added after the seeded draw above was fixed: drawn from a generator of their own, so the
cases of COMMANDS stay the ones that passed before."""


LATER2: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "profile": (["--model", "gpt2-tiny", "--set", "n_layer=1", "--seq", "8", "--repeats", "1", "--warmup", "0",
                 "--roofline"], {"--platform": PLATS, "--png": OUTS, "--json": [""], "--precision": ["x", "bf16"]}),
    "plan": (["--model", "gpt2-small", "--global-batch", "8", "--gpus-per-node", "2", "--set", "n_layer=2"],
             {"--fix": ["cp=2", "cp=x", "cp=0", "hsdp=2", "hsdp=-1", "pp_split=equal", "pp_split=x", "pp=3"],
              "--seq": INT, "--model": MODELS}),
}
"""Flags added on 2026-11-28 (profile --roofline, plan --fix cp/hsdp/pp_split): a generator of their own again."""


LATER3: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "plan": (["--model", "gpt2-small", "--global-batch", "8", "--gpus-per-node", "2", "--set", "n_layer=2"],
             {"--runs": ["0", "-1", "x", "2", "100000000"],
              "--platform": ["a100-80g:2,v100:2", "a100-80g:x", "h100:0", "nope:2", "a100-80g:2,", ":2", "gh200"],
              "--fix": ["offload=optimizer", "offload=none", "offload=x", "offload=activations", "offload=weights",
                        "fsdp_group=block", "fsdp_group=x"], "--model": ["mlp", "vgg-mini"]}),
}
"""Flags added in the fourth 2026-11-28 session (plan --runs, heterogeneous --platform lists, gh200, --fix offload
for traced models) and the fifth (--fix offload=activations|weights, fsdp_group=): a generator of their own again."""


WEIGHTS = {"estimate": 2, "remat": 1, "profile": 1, "checkpoint export": 1, "models": 0.1, "optimizers": 0.1}
"""Relative frequency of a command's cases (default 10): the ones whose valid cases build or export a model are
rarer, so that the whole test stays quick; `models` builds every reference model."""


def _cases(n: int, seed: int = 27, commands: dict | None = None) -> list[tuple[str, list[str]]]:
    commands = COMMANDS if commands is None else commands
    rng = random.Random(seed)
    names = list(commands)
    weights = [WEIGHTS.get(k, 10) for k in names]
    out = []
    for _ in range(n):
        name = rng.choices(names, weights)[0]
        base, pools = commands[name]
        argv = list(base)
        for opt in rng.sample(list(pools), k=min(len(pools), rng.randint(1, 3))):
            val = rng.choice(pools[opt])
            if opt.endswith("=") or opt in ("RUN", "FILE"):  # a positional (override or path)
                argv = [val if a == opt else a for a in argv] if opt in argv else argv + [opt + val if
                                                                                        opt.endswith("=") else val]
            else:
                argv += [opt] + ([val] if val else [])
        out.append((name, name.split() + argv))
    return out


CASES = _cases(int(os.environ.get("FUZZ_CMD_CASES", "1600")), int(os.environ.get("FUZZ_SEED", "27")))
CASES += _cases(int(os.environ.get("FUZZ_LATER_CASES", "150")), int(os.environ.get("FUZZ_SEED", "27")), LATER)
CASES += _cases(int(os.environ.get("FUZZ_LATER2_CASES", "60")), int(os.environ.get("FUZZ_SEED", "27")), LATER2)
CASES += _cases(int(os.environ.get("FUZZ_LATER3_CASES", "30")), int(os.environ.get("FUZZ_SEED", "27")), LATER3)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A directory with the input files above and a trained one-step run (``run``)."""
    d = tmp_path_factory.mktemp("fuzzcmd")
    for k, v in FILES.items():
        (d / k).write_bytes(v)
    (d / "adir").mkdir()
    (d / "afile").write_text("x")
    assert main(["train", "--out", str(d / "run"), "model.overrides={n_layer=1, n_embd=32, n_head=2}",
                 "data.seq_len=16", "data.name=synthetic-text", "train.global_batch=2", "train.eval_every=0",
                 "train.eval_batches=1", "train.steps=1", "train.progress=off", "optim.warmup_steps=0"]) == 0
    return d


def _tree(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


def test_every_command_exits_0_or_2_in_one_line_without_traceback(work, capsys, monkeypatch):
    monkeypatch.chdir(work)
    before = _tree(work)
    bad = []
    spent: dict[str, float] = {}
    for i, (name, argv) in enumerate(CASES):
        argv = [str(work / "run") if a == "RUN" else a for a in argv]
        capsys.readouterr()
        t0, raised = time.perf_counter(), ""
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 1
        except Exception as e:  # noqa: BLE001 - a traceback: what this test hunts
            rc, raised = -1, f"{type(e).__name__}: {e}"
        err = capsys.readouterr().err + raised
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        errors = [x for x in err.splitlines() if x.startswith("scaletrain") and ": error: " in x]
        if rc not in (0, 2) or "Traceback" in err:
            bad.append(f"CASES[{i}] {argv}: rc {rc}: {err[-300:]}")
        elif rc == 2 and len(errors) != 1:
            bad.append(f"CASES[{i}] {argv}: not one error line: {err[-300:]}")
        after = _tree(work)
        if after != before:
            if rc == 2:
                bad.append(f"CASES[{i}] {argv}: failed but wrote {sorted(after - before)[:3]}")
            for p in sorted(after - before, key=len, reverse=True):  # undone for the next case
                q = work / p
                q.unlink() if q.is_file() or q.is_symlink() else shutil.rmtree(q)
    print("seconds by command:", {k: round(v, 1) for k, v in sorted(spent.items(), key=lambda x: -x[1])})
    assert not bad, "\n".join(bad[:15]) + f"\n({len(bad)} of {len(CASES)} cases)"
