"""``scaletrain checkpoint export RUN --to hf``: a directory that ``transformers`` loads with
``from_pretrained`` (``config.json`` + ``model.safetensors``), streamed like the safetensors export.

Why: a model trained here is usually served or fine-tuned elsewhere, and the Hugging Face layout is
the one every such tool reads. Two sources have it:

* ``hf:`` models (:mod:`scaletrain.models.external`): the trainer's parameters already carry the
  model's own names, and its config is rebuilt from ``model.overrides`` (on the meta device);
* a family whose :class:`~scaletrain.models.spec.ModelSpec` declares an ``export`` mapping (the reference
  GPT-2 family, :mod:`scaletrain.models.gpt2.export`): the same architecture as
  ``GPT2LMHeadModel`` (pre-LN blocks, fused QKV, tanh GELU = HF's ``gelu_new``, tied head), with
  other names and ``nn.Linear`` weights where HF's ``Conv1D`` stores their transpose.

Any other model has no Hugging Face layout: one line names the formats that work.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError
from scaletrain.train import export
from scaletrain.train.model_record import is_python_only
from scaletrain.train.safe_write import write_atomic


def _model_section(path: Path) -> tuple[str, dict[str, Any]]:
    text = export.saved_config(path)
    try:
        model = tomllib.loads(text).get("model", {}) if text else {}
    except tomllib.TOMLDecodeError:
        model = {}
    if not model.get("name"):
        raise UserError(f"checkpoint {str(path)!r} does not record its model (no config); --to hf needs it; "
                        f"use --to safetensors")
    return str(model["name"]), dict(model.get("overrides", {}))


def export_hf(path: Path, out: Path) -> dict[str, Any]:
    """Write ``out/config.json`` and ``out/model.safetensors`` for checkpoint ``path``."""
    from scaletrain import models
    from scaletrain.models.external import is_external
    from scaletrain.models.spec import spec_of

    name, overrides = _model_section(path)
    module = None if is_python_only(name) else models.get(name, device="meta", **overrides)
    spec = spec_of(module) if module is not None else None
    if spec is not None and spec.export is not None:  # the family's own mapping (reference GPT-2)
        config, rename = spec.export(module)
    elif is_external(name) and hasattr(module, "config") and hasattr(module.config, "to_dict"):
        config, rename = module.config.to_dict(), None
        if not config.get("architectures"):  # a config built in memory says None: from_pretrained needs the class
            config["architectures"] = [type(module).__name__]
    else:
        raise UserError(f"model {name!r} has no Hugging Face layout; --to hf takes hf: models and the gpt2-* "
                        f"reference family; use --to safetensors")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {str(out)!r} exists and is not an empty directory; give a new directory")
    out.mkdir(parents=True, exist_ok=True)
    d = export.export_safetensors(path, out / "model.safetensors", rename=rename)
    write_atomic(out / "config.json", json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return {**d, "path": str(out), "model": name, "tokenizer": _copy_tokenizer(path, out)}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _copy_tokenizer(path: Path, out: Path) -> str | None:
    """The run's ``data.tokenizer`` files, copied beside the model so ``AutoTokenizer.from_pretrained(out)``
    finds them; None when the run used bytes (or the directory is gone: the model is still written)."""
    import shutil

    text = export.saved_config(path)
    try:
        tok = str(tomllib.loads(text).get("data", {}).get("tokenizer", "")) if text else ""
    except tomllib.TOMLDecodeError:
        tok = ""
    src = Path(tok).expanduser()
    src = src.parent if src.is_file() else src
    if not tok or not (src / "tokenizer.json").is_file():
        return None
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return str(src)
