"""Measuring and the platform sit below the techniques: they import none of them, and what they measure or
price is still what the techniques run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import scaletrain
from scaletrain import measure, platform

SRC = Path(scaletrain.__file__).parent
ABOVE = ("scaletrain.techniques", "scaletrain.planner", "scaletrain.train", "scaletrain.sweep", "scaletrain.compare",
         "scaletrain.commands", "scaletrain.cli")


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports or names as a dotted string (importlib)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("scaletrain."):
            out.add(node.value.split()[0])
    return out


@pytest.mark.parametrize("path", [SRC / "platform.py", SRC / "schema.py", SRC / "plan.py",
                                  *sorted((SRC / "measure").glob("*.py"))], ids=lambda p: p.name)
def test_lower_floors_name_no_layer_above(path):
    bad = sorted(m for m in _imports(path) if m.startswith(ABOVE))
    assert not bad, f"{path.name} imports {bad}"


def test_calibrated_cpu_adam_kernel_is_the_one_cpuadam_runs():
    from scaletrain.techniques.offload.optimizer import CPUAdam

    update, p = platform.cpu_adam_update(1000)
    q = torch.zeros(1000)
    q.grad = torch.full((1000,), 1e-3)
    opt = CPUAdam([q], lr=1e-3)
    for _ in range(3):
        update()
        opt.step()
    assert torch.equal(p, q) and p.abs().sum() > 0


def test_the_estimator_optimizers_are_the_registry_the_root_installs():
    from scaletrain.measure import optimizers
    from scaletrain.techniques.optim import registry

    assert optimizers.names() == list(registry.names())
    saved = measure._OPTIMIZERS
    try:
        measure.use_optimizers(None)  # without the technique: torch's own only, and said so in one line
        assert optimizers.names() == ["sgd", "adam", "adamw"]
        with pytest.raises(scaletrain.UserError, match="unknown optimizer 'lamb'; allowed: sgd, adam, adamw$"):
            optimizers.check("lamb")
    finally:
        measure.use_optimizers(saved)
    assert "lamb" in optimizers.names()


TECHNIQUES_ABOVE = ("scaletrain.planner", "scaletrain.train", "scaletrain.sweep", "scaletrain.compare",
                    "scaletrain.commands", "scaletrain.cli")


@pytest.mark.parametrize("path", sorted((SRC / "techniques").rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_techniques_import_neither_the_trainer_nor_the_planner(path):
    """The techniques sit below the loop, the launcher and the search: none of their files names one of them
    (the torchrun agent that starts the ranks is the launcher's, ``train/agent.py``)."""
    bad = sorted(m for m in _imports(path) if m.startswith(TECHNIQUES_ABOVE))
    assert not bad, f"{path.relative_to(SRC)} imports {bad}"


PLANNER_ABOVE = ("scaletrain.train", "scaletrain.sweep", "scaletrain.compare", "scaletrain.commands", "scaletrain.cli")


@pytest.mark.parametrize("path", sorted((SRC / "planner").rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_the_planner_imports_neither_the_trainer_nor_the_sweep(path):
    """The trainer (plan=auto) and the sweep (plan --runs) call the planner, never the other way round."""
    bad = sorted(m for m in _imports(path) if m.startswith(PLANNER_ABOVE))
    assert not bad, f"{path.relative_to(SRC)} imports {bad}"
