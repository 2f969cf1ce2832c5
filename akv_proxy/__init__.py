"""akv_proxy: an OpenAI-compatible proxy that applies an AKV cache policy to any agent's requests.

    app = create_proxy_app(load_policy("best.akvp"), "http://127.0.0.1:30000", counter)

Each chat request gets the policy's decision for its history (kv mode: `drop_message` /
`reposition` or `drop_rule` added; text mode: the history edited, summaries written by the
upstream model) and is forwarded; replies, streamed or not, come back unchanged. A request that
carries AKV fields of its own passes untouched. It sits above `sandbox` (the harness's token
counter and text editor) and beside `evolve`, which it never imports. See docs/proxy.md.
"""
from __future__ import annotations

from akv_proxy.app import create_proxy_app

__all__ = ["create_proxy_app"]
