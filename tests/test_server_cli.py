"""`akv serve` as a user runs it: a separate process that prints its URL when ready."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import httpx
import pytest

from test_server_support import interrupt, ready_url

AKV = [sys.executable, "-m", "akv_cli.main"]


def run_akv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AKV, *args], capture_output=True, text=True, timeout=120)


def test_a_missing_model_is_one_error_line_and_exit_2(tmp_path) -> None:
    missing = tmp_path / "nothing-here.gguf"
    result = run_akv("serve", "--model", str(missing))
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert "not found" in result.stderr and str(missing) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_taken_port_is_one_error_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_akv("serve", "--port", str(port))
    assert result.returncode == 2
    assert f"error: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("option", "value"), [("--device", "tpu"), ("--precision", "int3"),
                                               ("--log-level", "loud")])
def test_an_unknown_choice_is_refused_by_the_option_parser(option: str, value: str) -> None:
    result = run_akv("serve", option, value)
    assert result.returncode == 2
    assert value in result.stderr and "Traceback" not in result.stderr


@pytest.mark.server
@pytest.mark.model
def test_serve_prints_its_url_and_answers() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # fp16 weights: the faster CPU path, exercised end to end here.
    process = subprocess.Popen([*AKV, "serve", "--port", "0", "--kv-tokens", "4096",
                                "--device", "cpu", "--precision", "fp16"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = ready_url(process)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "smollm2"
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200
    finally:
        interrupt(process)
    # Ctrl-C ends the server quietly: 130 is the shell's code for "stopped by SIGINT".
    assert process.returncode in (0, 130)
    stderr = process.stderr.read()
    assert "Traceback" not in stderr
    # The default log level (info) writes one access line per request, with its tokens.
    assert re.search(r"akv\.access: POST /v1/chat/completions 200 prompt=\d+ completion=\d+ cached=\d+ "
                     r"latency=\d+\.\d{3}s", stderr), stderr
    assert "GET /health 200 prompt=- completion=- cached=-" in stderr
