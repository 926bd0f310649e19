"""The example a Python user runs first, run as they run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "two_stages.py"


def test_the_two_stage_example_reloads_in_place_and_gives_the_same_output():
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)], check=False, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    reloads = [line.split() for line in lines if line.startswith("reload")]
    assert [(r[1], r[-1]) for r in reloads] == [("encoder", "in_place"), ("decoder", "in_place")]
    assert lines[-1] == "same output both runs: True"
