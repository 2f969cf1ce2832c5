"""The one thread-count rule (`akv_core.threads`): decode through torch on 1 thread, decode on the fused
kernels on the idle cores (this process's own load not counted against them), prefill on the idle cores."""
from __future__ import annotations

import math
import os

import pytest

from akv_core import threads


def test_idle_cores_discount_this_processs_own_load():
    assert threads.idle_of(2, 2.1, 0.0) == 1          # the cores busy with others' work
    assert threads.idle_of(2, 2.1, 1.9) == 2          # ... or with ours: both are free for us
    assert threads.idle_of(2, 1.4, 0.0) == 1 and threads.idle_of(2, 1.4, 1.0) == 2
    assert threads.idle_of(4, 0.3, 2.0) == 4 and threads.idle_of(4, 9.0, 0.0) == 1   # within 1..cores
    assert threads.averaged(0.0, 1.0, threads.LOAD_WINDOW_S) == pytest.approx(1 - 1 / math.e)
    assert 0.0 <= threads.own_load() <= (os.cpu_count() or 1) + 0.5


def test_the_decode_thread_count_depends_on_the_kernels(monkeypatch):
    monkeypatch.delenv("AKV_DECODE_THREADS", raising=False)
    monkeypatch.delenv("AKV_PREFILL_THREADS", raising=False)
    cores = os.cpu_count() or 1   # the load average moves between readings: bounds, not equalities
    assert threads.threads_for("decode") == threads.DECODE_THREADS == 1
    assert 1 <= threads.threads_for("decode", fused=True) <= min(cores, threads.FUSED_DECODE_MAX_THREADS)
    assert threads.threads_for("prefill", 10) == 1 and 1 <= threads.threads_for("prefill", 64) <= cores
    monkeypatch.setenv("AKV_DECODE_THREADS", "3")
    assert threads.threads_for("decode") == threads.threads_for("decode", fused=True) == 3
    monkeypatch.setenv("AKV_DECODE_THREADS", "two")
    with pytest.raises(ValueError, match="AKV_DECODE_THREADS must be a positive integer"):
        threads.threads_for("decode")
    with pytest.raises(ValueError, match="phase must be"):
        threads.threads_for("train")
