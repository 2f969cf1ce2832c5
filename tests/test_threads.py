"""The one thread-count rule (`akv_core.threads`): decode through torch on 1 thread, decode on the C
kernels and prefill on the idle cores, judged from the machine's busy CPU time less this process's own
forward passes."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from akv_core import threads


def _stat(user: int, system: int, idle: int, steal: int = 0) -> str:
    """A /proc/stat text whose first line has these tick counts (nice, iowait, irq and softirq zero)."""
    return f"cpu  {user} 0 {system} {idle} 0 0 0 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 1 2\n"


def test_the_idle_cores_are_the_cores_less_the_work_elsewhere():
    assert threads.idle_of(2, 1.1) == 1 and threads.idle_of(2, 0.4) == 2 and threads.idle_of(2, 0.6) == 1
    assert threads.idle_of(4, 9.0) == 1 and threads.idle_of(4, -1.0) == 4   # within 1..cores
    assert threads.averaged(0.0, 1.0, threads.BUSY_WINDOW_S) == pytest.approx(1 - 1 / math.e)
    # busy: user + nice + system + irq + softirq + steal; idle and iowait are not
    assert threads.machine_busy_s(_stat(100, 50, 900, steal=10)) == pytest.approx(160 / threads.TICKS_PER_S)
    assert threads.machine_busy_s("intr 1 2\n") is None


def test_the_meter_counts_the_machine_less_this_processs_forward_passes(tmp_path):
    stat = tmp_path / "stat"
    clock = [100.0]
    meter = threads.BusyMeter(str(stat), clock=lambda: clock[0])
    ticks = threads.TICKS_PER_S
    stat.write_text(_stat(0, 0, 0))
    assert meter.busy_elsewhere() is None            # one reading: no rate yet
    clock[0] += 1.0
    stat.write_text(_stat(2 * ticks, 0, 0))          # 2 cores' worth busy for 1 s ...
    meter.add_forward(1.5)                           # ... 1.5 of it in this process's forward passes
    assert meter.busy_elsewhere() == pytest.approx(0.5)
    clock[0] += threads.SAMPLE_EVERY_S / 2           # too soon for a new reading: the same figure
    stat.write_text(_stat(10 * ticks, 0, 0))
    assert meter.busy_elsewhere() == pytest.approx(0.5)
    clock[0] += threads.BUSY_WINDOW_S                # then the average moves toward the new rate (here 8 CPU
    elapsed = threads.SAMPLE_EVERY_S / 2 + threads.BUSY_WINDOW_S   # seconds over 2.125 s)
    assert meter.busy_elsewhere() == pytest.approx(threads.averaged(0.5, 8 / elapsed, elapsed))
    assert threads.BusyMeter(str(tmp_path / "missing")).busy_elsewhere() is None


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _busy_while(work, inside_forward: bool) -> float:
    meter = threads.BusyMeter()
    meter.busy_elsewhere()
    if inside_forward:
        with threads.forward_cpu(meter):
            work()
    else:
        work()
    seen = meter.busy_elsewhere()
    assert seen is not None
    return seen


@pytest.mark.skipif(not os.path.exists(threads.PROC_STAT), reason="no /proc/stat on this platform")
def test_other_work_is_seen_and_this_processs_forward_passes_are_not():
    spin = "import time\nend = time.perf_counter() + 1.6\nwhile time.perf_counter() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.3)                                  # the child has started spinning
    elsewhere = _busy_while(lambda: time.sleep(1.0), inside_forward=False)
    child.wait()
    assert elsewhere >= 0.6, elsewhere               # one core spinning in another process (more if busy)
    outside = _busy_while(lambda: _spin(1.0), inside_forward=False)
    inside = _busy_while(lambda: _spin(1.0), inside_forward=True)
    assert outside - inside >= 0.5, (outside, inside)   # the same spin, counted only outside a forward pass


def test_the_thread_counts_and_the_overrides(monkeypatch):
    for name in ("AKV_DECODE_THREADS", "AKV_PREFILL_THREADS"):
        monkeypatch.delenv(name, raising=False)
    cores = os.cpu_count() or 1   # what is idle moves between readings: bounds, not equalities
    assert threads.threads_for("decode") == threads.DECODE_THREADS == 1
    assert 1 <= threads.threads_for("decode", kernels=True) <= min(cores, threads.KERNEL_DECODE_MAX_THREADS)
    assert threads.threads_for("prefill", 10) == 1 and 1 <= threads.threads_for("prefill", 64) <= cores
    monkeypatch.setenv("AKV_DECODE_THREADS", "3")
    assert threads.threads_for("decode") == threads.threads_for("decode", kernels=True) == 3
    monkeypatch.setenv("AKV_DECODE_THREADS", "two")
    with pytest.raises(ValueError, match="AKV_DECODE_THREADS must be a positive integer"):
        threads.threads_for("decode")
    monkeypatch.setenv("AKV_PREFILL_THREADS", "0")
    with pytest.raises(ValueError, match="AKV_PREFILL_THREADS must be a positive integer"):
        threads.threads_for("prefill", 512)
    with pytest.raises(ValueError, match="phase must be"):
        threads.threads_for("train")


def test_a_forward_pass_restores_the_thread_count_and_is_counted(monkeypatch):
    import torch

    monkeypatch.setenv("AKV_PREFILL_THREADS", "1")
    before, counted = torch.get_num_threads(), threads.METER._forward_s
    with threads.phase_threads("prefill", 512) as chosen:
        assert chosen == 1 == torch.get_num_threads()
        _spin(0.02)
    assert torch.get_num_threads() == before
    assert threads.METER._forward_s - counted > 0   # counted (how much depends on the machine's load)


def test_a_decode_step_on_the_kernels_keeps_torchs_operators_on_one_thread(monkeypatch):
    """The kernels get the phase's count; torch's small operators around them one thread (no OpenMP threads left
    spinning on the kernels' cores); both restored after, and a call outside any step takes torch's count."""
    import torch

    from akv_core.kernels import cpu_gemv

    monkeypatch.setenv("AKV_DECODE_THREADS", "2")
    before = torch.get_num_threads()
    with threads.phase_threads("decode", kernels=True) as chosen:
        assert chosen == 2 == cpu_gemv.default_threads() and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before == cpu_gemv.default_threads()
    with threads.phase_threads("decode") as chosen:   # torch's operators: the count is theirs
        assert chosen == 2 == torch.get_num_threads() == cpu_gemv.default_threads()
