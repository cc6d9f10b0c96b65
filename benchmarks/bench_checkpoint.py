"""Benchmark of checkpoints: accel's save_state / load_state / save_model vs Accelerate's, side by side.

One process, one model (an MLP of about `--params` million parameters with Adam state),
the two libraries alternately for several rounds, in fresh folders. accel writes every
file atomically (a temporary file, fsync, rename), which Accelerate does not: the ratio
shows what that safety costs. Medians are printed with the ratio accel / Accelerate.

    python benchmarks/bench_checkpoint.py [--rounds 5] [--params 25]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch


def _setup(library: str, params_millions: float) -> tuple[Any, Any]:
    if library == "accelerate":
        import accelerate
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        acc: Any = accelerate.Accelerator()
    else:
        import accel
        from accel.state import reset_state

        reset_state()
        acc = accel.Accelerator()
    width = int((params_millions * 1e6 / 4) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # Adam's state exists: the optimizer file is twice the model's size
    return acc, model


def _time(action: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    action(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--params", type=float, default=25.0, help="model size, millions of parameters")
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for library in ("accel", "accelerate"):
            acc, model = _setup(library, args.params)
            with tempfile.TemporaryDirectory() as folder:
                times.setdefault((library, "save_state"), []).append(_time(acc.save_state, f"{folder}/ckpt"))
                times.setdefault((library, "load_state"), []).append(_time(acc.load_state, f"{folder}/ckpt"))
                export = (model, f"{folder}/export", "40MB")
                times.setdefault((library, "save_model"), []).append(_time(acc.save_model, *export))
    print(f"{args.params:g}M parameters (+ Adam state), median of {args.rounds} rounds, same process, alternating")
    for name in ("save_state", "load_state", "save_model"):
        ours = statistics.median(times[("accel", name)])
        theirs = statistics.median(times[("accelerate", name)])
        print(
            f"{name:11s} accel {ours * 1000:8.1f} ms   accelerate {theirs * 1000:8.1f} ms   ratio {ours / theirs:5.2f}"
        )


if __name__ == "__main__":
    main()
