"""akv_proxy: an OpenAI-compatible proxy that applies an AKV cache policy to any agent's requests.

    app = create_proxy_app(load_policy("best.akvp"), "http://127.0.0.1:30000", counter)

Each chat request gets the policy's decision for its history (kv mode: `drop_message` /
`reposition` or `drop_rule` added; text mode: the history edited, summaries written by the
upstream model) and is forwarded; replies, streamed or not, come back unchanged. A request that
carries AKV fields of its own passes untouched. It imports only `akv_core` (the chat tokenizer's
counts, the chat client for summaries, the server's guard and errors) and `policy_dsl` (the
policy, the text editor the harness uses too): never the sandbox, the store or `evolve`. `akv
proxy --record` hands in the sandbox's trace-set recording (recorder.py). See docs/proxy.md.
"""
from __future__ import annotations

from akv_proxy.app import create_proxy_app

__all__ = ["create_proxy_app"]
