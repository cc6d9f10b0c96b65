"""`examples/fit_batch.py --compare L4 H100`: the largest batch of a transformer on simulated cards, DDP and FSDP2."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

# the example as a user runs it: four simulated launches of two ranks each, searching batches (about 50 s)
pytestmark = pytest.mark.processes

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fit_batch.py"


def test_a_bigger_card_fits_a_bigger_batch_and_every_peak_fits_its_card():
    # a small model (the example's default is GPT-2 small): the search is the same, the run shorter
    small = ["--layers", "1", "--width", "64", "--heads", "2", "--seq", "512", "--vocab", "8192"]
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--compare", "L4", "H100", *small],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^  (.+?)\s+(ddp|fsdp2)\s+batch\s+(\d+)\s+peak\s+([\d.]+) GiB$", done.stdout, re.MULTILINE)
    found = {(card.strip(), strategy): (int(batch), float(peak)) for card, strategy, batch, peak in rows}
    assert set(found) == {(c, s) for c in ("NVIDIA L4", "NVIDIA H100 80GB HBM3") for s in ("ddp", "fsdp2")}
    for strategy in ("ddp", "fsdp2"):
        l4, h100 = found[("NVIDIA L4", strategy)], found[("NVIDIA H100 80GB HBM3", strategy)]
        assert 1 <= l4[0] < h100[0]
        assert l4[1] < 22.03 and h100[1] < 79.19
