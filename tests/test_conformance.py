"""`akv conformance URL` against a real `akv serve` process, and against no server at all."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_server_support import interrupt, ready_url

from akv_cli.conformance import CHECKS, FAIL, PASS, UNSUPPORTED, Result, format_table, run_checks

AKV = [sys.executable, "-m", "akv_cli.main"]


@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_akv_serve_passes_every_check_it_supports() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*AKV, "serve", "--port", "0", "--kv-tokens", "4096", "--device", "cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = ready_url(process)
        done = subprocess.run([*AKV, "conformance", url], capture_output=True, text=True, env=env, timeout=900)
    finally:
        interrupt(process)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split("  ")[0].strip(): line for line in done.stdout.splitlines()}
    for name, _ in CHECKS:
        assert name in rows, (name, done.stdout)
    unsupported = [name for name, line in rows.items() if f"  {UNSUPPORTED}  " in line]
    assert unsupported == [], done.stdout   # our server implements every upstream drop rule
    assert f"0 {FAIL}" in done.stdout.splitlines()[-1]


def test_a_server_that_is_not_there_cannot_be_checked_and_exits_2() -> None:
    results = run_checks("http://127.0.0.1:9", timeout=2)  # the discard port: nothing listens
    assert [r.status for r in results] == [FAIL] and results[0].name == "models"
    done = subprocess.run([*AKV, "conformance", "http://127.0.0.1:9", "--timeout", "2"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: cannot check http://127.0.0.1:9: ")
    assert done.stdout.splitlines()[2].split()[:2] == ["models", FAIL]
    assert done.stdout.splitlines()[-1] == f"1 checks: 0 {PASS}, 1 {FAIL}, 0 not supported"


def test_the_table_fits_80_columns_and_json_has_every_check() -> None:
    long = "refused: drop_rule.type: Input tag 'text_drop' found using 'type' does not match any of the expected tags"
    results = [Result("models", PASS, "serving smollm2; checking smollm2"), Result("drop_rule text_drop", UNSUPPORTED,
                                                                                     long)]
    lines = format_table(results, 80).splitlines()
    assert max(map(len, lines)) <= 80 and lines[3].split()[:4] == ["drop_rule", "text_drop", "not", "supported"]
    assert " ".join(" ".join(lines[3:-1]).split()).endswith(long) and lines[-1] == "2 checks: 1 pass, 0 fail, 1 not supported"
    done = subprocess.run([*AKV, "conformance", "http://127.0.0.1:9", "--timeout", "2", "--json"],
                          capture_output=True, text=True)
    shown = json.loads(done.stdout)
    assert done.returncode == 2 and [c["name"] for c in shown["checks"]] == ["models"]
    assert shown["checks"][0]["status"] == FAIL and done.stderr.startswith("error: cannot check ")
