"""`akv serve`: the OpenAI-compatible AKV server on the embedded model or your own."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import NoReturn

import typer

from akv_cli.errors import VERDICT, fail
from akv_cli.options import key_option
from akv_core.model.precisions import PRECISIONS


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


# The matmul weights' precision (activations and the KV pool stay float32): float32 exact; fp16 about
# 1.8x faster decode on an AVX2 CPU; mixed the same as fp16; int8 per row and int4 in groups of 32 (a
# GGUF's Q4_0 / Q4_1 as stored) on the CPU only. The reduced ones prefill in bf16 where the CPU multiplies
# bf16 natively (AKV_PREFILL overrides: akv_core.model.prefill).
Precision = Enum("Precision", {name: name for name in PRECISIONS}, type=str)
PRECISION_HELP = ("Weight precision: float32 (exact), fp16, mixed, int8 or int4 (faster on the CPU; "
                  "docs/engine-model.md).")
CONTEXT_HELP = ("Context to serve in tokens (default: the model's); beyond the trained one it needs "
                "--rope-scaling.")
API_KEY_HELP = ("Require the header `Authorization: Bearer KEY` on every request but GET /health "
                "(default: none, anyone who can connect may call; docs/server.md, Running exposed).")
MAX_BODY_HELP = ("Refuse request bodies over this many bytes with a 413 (default: 1 KiB per token of the "
                 "served context, room for the longest history it holds: 8 MiB at 8,192 tokens).")
CHECK_HELP = ("Check everything serving needs (the model, the options, the port) and load the model, print the "
              "kernels it would run on, then exit without serving: 0, or 1 where something has a fix (C kernels "
              "refused: the reason and the fix are printed).")
ROPE_SCALING_HELP = ("Stretch RoPE past the trained context: yarn, linear, KIND:FACTOR (yarn:4) or none; "
                     "without a factor it is --context over the trained context (default: none; docs/server.md).")


def register(app: typer.Typer) -> None:
    """Add this group's commands to the root app."""
    app.command(name="serve")(serve)


def serve(
    model: str = typer.Option("smollm2", help="'smollm2' (embedded), a .gguf file, or a Hugging Face folder."),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(30000, min=0, max=65535, help="Port to bind (0: any free port)."),
    kv_tokens: int | None = typer.Option(None, min=1, help="KV pool size in tokens (default: the engine's)."),
    max_running: int | None = typer.Option(None, min=1, help="Requests decoded together at most (default 8)."),
    device: Device = typer.Option(Device.auto, help="Where the model runs."),
    precision: Precision = typer.Option(Precision.float32, help=PRECISION_HELP),
    prefill_chunk: int | None = typer.Option(None, min=0, help="Prompt tokens computed per engine step, shared "
                                             "by the prompts in progress (default: the engine's; 0: whole "
                                             "prompts)."),
    context: int | None = typer.Option(None, min=1, help=CONTEXT_HELP),
    rope_scaling: str | None = typer.Option(None, help=ROPE_SCALING_HELP),
    log_level: LogLevel = typer.Option(LogLevel.info, help="info logs one access line per request; "
                                       "warning and error only problems."),
    api_key: str | None = typer.Option(None, envvar="AKV_SERVE_API_KEY", help=API_KEY_HELP),
    max_body_bytes: int | None = typer.Option(None, min=1, help=MAX_BODY_HELP),
    check: bool = typer.Option(False, "--check", help=CHECK_HELP),
) -> None:
    """Serve POST /v1/chat/completions with drop_message / reposition, plus /health, /v1/models, /metrics."""
    # Heavy imports here so that `akv --help` stays fast.
    from akv_core.model.locate import EMBEDDED_NAME, ModelNotFoundError, locate
    from akv_core.server.app import create_app
    from akv_core.server.runner import can_bind, serve_forever

    try:
        located = locate(model)
    except ModelNotFoundError as error:
        fail(str(error))
    _check_context(model, context, rope_scaling)
    api_key = key_option(api_key, "AKV_SERVE_API_KEY", "--api-key")
    _check_access(host, api_key)
    if not can_bind(host, port):
        fail(f"cannot listen on {host}:{port} (is the port taken?)")
    chosen = _device(device)
    typer.echo(f"loading {model} on {chosen} ...", err=True)
    engine = _load_engine(model, chosen, kv_tokens, max_running, precision.value, prefill_chunk,
                          context, rope_scaling)
    name = EMBEDDED_NAME if model.lower() == EMBEDDED_NAME else Path(located.path).stem
    if check:
        _report_check(engine, name, chosen, host, port)
    app = create_app(engine, name, aliases=frozenset({model}), api_key=api_key, max_body_bytes=max_body_bytes)
    ready = serve_forever(app, host, port, on_ready=lambda url: typer.echo(
        f"AKV server ready at {url} ({kernels_line(engine.model)})"), log_level=log_level.value)
    if not ready:
        fail(f"cannot listen on {host}:{port} (is the port taken?)")


def kernels_line(model: object) -> str:
    """What the model runs on, for the start-up line and --check: the prompts' product and attention kernels
    (akv_core.model.prefill), and where the C kernels were refused, why and the fix."""
    line = f"prefill: {getattr(model, 'prefill_path', None)}; attention: {getattr(model, 'prefill_attention', None)}"
    refusal = getattr(model, "kernels_refusal", None)
    return line if refusal is None else f"{line}; C kernels not loaded: {refusal}"


def _report_check(engine: object, name: str, device: str, host: str, port: int) -> NoReturn:
    """--check: the line the server would start with, then exit 0, or 1 where a refusal has a fix."""
    model = getattr(engine, "model", None)
    typer.echo(f"akv serve would serve {name} on {device} at {host}:{port} ({kernels_line(model)})")
    refusal = getattr(model, "kernels_refusal", None)
    raise typer.Exit(VERDICT if refusal is not None and refusal.fix is not None else 0)


def _check_access(host: str, api_key: str | None) -> None:
    """A key that cannot be sent ends the command; serving beyond loopback without one is warned about."""
    from akv_core.server.guard import check_api_key, exposure_warning

    try:
        check_api_key(api_key)
    except ValueError as error:
        fail(str(error))
    warning = exposure_warning(host, api_key, "anyone who can reach the port can use the model")
    if warning is not None:
        typer.echo(warning, err=True)


def _device(device: Device) -> str:
    import torch

    if device is Device.auto:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device is Device.cuda and not torch.cuda.is_available():
        fail("--device cuda was asked for but no CUDA device is available")
    return device.value


def _check_context(model: str, context: int | None, rope_scaling: str | None) -> None:
    """A bad --context / --rope-scaling ends the command before the weights load, naming the option."""
    from akv_core.model.loader import model_config
    from akv_core.model.stretch import stretch

    if context is None and rope_scaling is None:
        return
    try:
        stretch(model_config(model), context, rope_scaling, fields=("--context", "--rope-scaling"))
    except ValueError as error:
        fail(str(error))


def _load_engine(model: str, device: str, kv_tokens: int | None, max_running: int | None,  # noqa: ANN202
                 precision: str, prefill_chunk: int | None, context: int | None = None,
                 rope_scaling: str | None = None):
    from akv_core import Engine

    options = {"device": device, "precision": precision, "context_length": context, "rope_scaling": rope_scaling}
    if prefill_chunk is not None:
        options["prefill_chunk"] = prefill_chunk or None   # 0: whole prompts in one step
    if kv_tokens is not None:
        options["kv_tokens"] = kv_tokens
    if max_running is not None:
        options["max_running"] = max_running
    try:
        return Engine.from_pretrained(model, **options)
    except (FileNotFoundError, ValueError) as error:
        fail(f"cannot load {model}: {error}")
