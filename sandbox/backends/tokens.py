"""The one chat tokenizer the sandbox counts and renders with: `akv_core.chat.shared_tokenizer`.

The policy counts tokens with it on every backend, so a policy's decisions do not depend on
which backend serves the requests; the replay backend renders with it, and the proxy counts with
the same one. It lives in `akv_core.chat` so that the proxy need not import the sandbox.
"""
from __future__ import annotations

from akv_core.chat import shared_tokenizer

__all__ = ["shared_tokenizer"]
