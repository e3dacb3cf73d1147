"""``scaletrain checkpoint info|export|import``: what a checkpoint holds; its model as one file and back."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scaletrain.argtypes import check_output
from scaletrain.errors import UserError

NAME = "checkpoint"
HELP = "describe a checkpoint (info), export its model to one safetensors file (export), or import one (import)"
DESCRIPTION = """Checkpoints are sharded directories (step_N/ with manifest.json and one file per rank) or
consolidated files (step_N.pt). RUN may be a run directory (its newest checkpoint), its checkpoints/
directory, or one checkpoint.

  scaletrain checkpoint info runs/x [--json]            step, plan/layout written under, sizes, integrity
  scaletrain checkpoint export runs/x --to safetensors  the model, streamed tensor by tensor
  scaletrain checkpoint import model.safetensors --out runs/y   then: scaletrain train --out runs/y --resume ..."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    i = sub.add_parser("info", help="step, plan, layout, sizes and integrity of a checkpoint")
    i.add_argument("run", help="run directory, checkpoints directory, or one checkpoint")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--no-verify", action="store_true", help="skip the CRC32 check of a sharded checkpoint's files")
    e = sub.add_parser("export", help="write the model as one safetensors file (streamed)")
    e.add_argument("run", help="run directory, checkpoints directory, or one checkpoint")
    e.add_argument("--to", default="safetensors", choices=("safetensors", "hf"),
                   help="safetensors: one file with scaletrain's names; hf: a directory transformers' from_pretrained "
                        "loads (hf: models and the gpt2-* family)")
    e.add_argument("--out", default=None,
                   help="output file, or directory with --to hf (default: beside the checkpoint)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    m = sub.add_parser("import", help="a safetensors file as the step-0 checkpoint of a new run directory")
    m.add_argument("file", help="a .safetensors file with the model's single-process tensor names")
    m.add_argument("--out", required=True, help="the new run directory (must not exist or be empty)")
    m.add_argument("--json", action="store_true", help="print one JSON object")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return ""


def run(args: argparse.Namespace) -> int:
    from scaletrain.train import export

    if args.action == "import":
        d = export.import_safetensors(Path(args.file), Path(args.out))
        print(json.dumps(d) if args.json else f"wrote {d['path']}: {d['tensors']} tensors, {_size(d['bytes'])}; "
              f"start from it with `scaletrain train --out {args.out} --resume ...`")
        return 0
    path = export.resolve(Path(args.run))
    if args.action == "info":
        d = export.info(path, verify=not args.no_verify)
        if args.json:
            print(json.dumps(d))
            return 0 if d["problem"] is None else 2
        if d["step"] is None:  # the manifest itself is unsound: nothing else of it is believed
            print(f"checkpoint {d['path']}: {d['format']}\nintegrity: DAMAGED ({d['problem']})")
            return 2
        plan = d["plan"]
        keys = ("dp", "tp", "pp", "cp", "ep", "zero", "precision", "optimizer")
        shown = ", ".join(f"{k}={plan[k]}" for k in keys if k in plan)
        sizes = list(d["files"].values())
        print(f"checkpoint {d['path']}: {d['format']}, step {d['step']}, written by {d['world']} process(es)")
        print(f"plan: {shown or '(not recorded)'}" + (f"; layout: {d['layout']}" if d["layout"] else ""))
        print(f"model: {d['parameters']:,} parameters in {d['tensors']} tensors; {_size(d['bytes'])} on disk in "
              f"{len(sizes)} file(s), {_size(min(sizes))} .. {_size(max(sizes))} each")
        print("integrity: " + ("ok" if d["problem"] is None else f"DAMAGED ({d['problem']})"))
        return 0 if d["problem"] is None else 2
    if args.to not in ("safetensors", "hf"):
        raise UserError(f"--to {args.to!r} is not supported; allowed: safetensors, hf")
    if args.to == "hf":
        from scaletrain.train.export_hf import export_hf

        out = Path(args.out) if args.out else path.with_name(path.name.removesuffix(".pt") + "-hf")
        check_output("--out", out, directory=True)
        d = export_hf(path, out)
        print(json.dumps(d) if args.json else f"wrote {d['path']}: config.json and model.safetensors ({d['tensors']} "
              f"tensors, {_size(d['bytes'])}); load it with transformers' from_pretrained")
        return 0
    out = Path(args.out) if args.out else path.with_name(path.name.removesuffix(".pt") + ".safetensors")
    check_output("--out", out)
    d = export.export_safetensors(path, out)
    print(json.dumps(d) if args.json else f"wrote {d['path']}: {d['tensors']} tensors, {_size(d['bytes'])}")
    return 0
