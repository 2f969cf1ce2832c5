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


@pytest.mark.server
@pytest.mark.model
def test_a_refused_kernel_is_named_with_its_fix_at_start_up_in_server_info_and_by_check(tmp_path) -> None:
    from akv_core.kernels import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip(f"cpu_gemv: {cpu_gemv.why_unavailable()}")
    unsafe = tmp_path / "kernels"   # a kernel folder others may write: its library is refused
    unsafe.mkdir()
    unsafe.chmod(0o777)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "AKV_KERNEL_CACHE": str(unsafe)}
    reason = f"the kernel folder {unsafe} is writable by group or others (mode 0777)"
    fix = f"fix: rm -r {unsafe} (it is made again, private, with a fresh build, at the next start)"
    serve = [*AKV, "serve", "--port", "0", "--kv-tokens", "1024", "--device", "cpu"]
    process = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        url = re.search(r"ready at (http://127\.0\.0\.1:\d+)", line).group(1)
        kernels = httpx.get(url + "/server_info", timeout=60).json()["cpu_kernels"]
    finally:
        interrupt(process)
    assert f"attention: torch's SDPA; C kernels not loaded: {reason}" in line and fix in line, line
    assert kernels["available"] is False and reason in kernels["reason"] and f"fix: {kernels['fix']}".startswith(fix)
    checked = subprocess.run([*serve, "--check"], capture_output=True, text=True, timeout=300, env=env)
    assert checked.returncode == 1, checked.stderr
    assert checked.stdout.startswith("akv serve would serve smollm2 on cpu at 127.0.0.1:0 (prefill: ")
    assert reason in checked.stdout and fix in checked.stdout
