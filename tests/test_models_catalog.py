"""`scaletrain models` reads a catalog (no torch): its counts are the built models' and it answers fast."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scaletrain import models
from scaletrain.models.catalog import LISTED
from scaletrain.models.external import HF_FAMILIES


def test_catalog_counts_are_the_models():
    for name in models.names():
        m = models.get(name, device="meta")
        assert LISTED[name].parameters == models.count_params(m), name
        assert LISTED[name].task == getattr(m, "task", ""), name
    pytest.importorskip("transformers")
    for fam in HF_FAMILIES:
        assert LISTED[f"hf:{fam}"].parameters == models.count_params(models.get(f"hf:{fam}", device="meta")), fam


def test_the_cli_lists_models_without_importing_torch():
    """The whole CLI parser is built (every command's arguments) and `models` runs, torch never imported."""
    code = ("import sys; from scaletrain.cli import main; main(['models']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "gpt2-tiny" in out.stdout and "858,880" in out.stdout


def test_remat_methods_are_the_configs():
    from scaletrain.techniques.remat import METHODS
    from scaletrain.train.config import RematConfig

    assert RematConfig.__dataclass_fields__["method"].metadata["choices"] == METHODS
