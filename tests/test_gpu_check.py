"""benchmarks/gpu_check.py explains itself and exits cleanly where there is no CUDA GPU."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check itself runs there")
def test_without_a_gpu_it_says_why_and_exits_0() -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU" in done.stdout and "docs/gpu.md" in done.stdout
