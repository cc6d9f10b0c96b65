"""Types tell the truth: what a type checker sees of the public API (runs mypy on a snippet)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import accel

mypy_api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = textwrap.dedent(
    """
    import torch
    from accel import Accelerator, PartialState, AcceleratorState

    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4)))
    prepared_model, prepared_optimizer, prepared_loader = accelerator.prepare(model, optimizer, loader)
    only_model = accelerator.prepare(model)
    reveal_type(prepared_model)
    reveal_type(prepared_optimizer)
    reveal_type(prepared_loader)
    reveal_type(only_model)
    reveal_type(PartialState().num_processes)
    reveal_type(PartialState().device)
    reveal_type(AcceleratorState().process_index)
    """
)

EXPECTED = [
    "torch.nn.modules.linear.Linear",
    "torch.optim.sgd.SGD",
    "torch.utils.data.dataloader.DataLoader[tuple[torch._tensor.Tensor, ...]]",
    "torch.nn.modules.linear.Linear",
    "int",
    "torch._C.device",
    "int",
]


def test_public_names_and_prepare_keep_their_types(tmp_path: Path) -> None:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    stdout, stderr, _ = mypy_api.run(
        ["--follow-imports=silent", "--cache-dir", str(ROOT / ".mypy_cache"), "--no-error-summary", str(snippet)]
    )
    revealed = re.findall(r'Revealed type is "([^"]+)"', stdout)
    assert ": error:" not in stdout, stdout + stderr
    assert revealed == EXPECTED, stdout + stderr


def test_package_ships_py_typed() -> None:
    assert (Path(accel.__file__).parent / "py.typed").is_file()
