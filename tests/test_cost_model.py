"""The cost model: the price file, the billing rule, and usage parsing."""
from __future__ import annotations

import json

import pytest

from sandbox.runs.cost import PRICES_FILE, TokenTotals, ReportedUsage, price_table, table_names


def _usage(prefilled: int = 0, cached: int = 0, repos: int = 0, dropped: int = 0, output: int = 0) -> ReportedUsage:
    return ReportedUsage(prefilled + cached + repos + dropped, output, cached, dropped, repos, prefilled)


def test_price_file_names_its_source_date_and_the_required_tables() -> None:
    data = json.loads(PRICES_FILE.read_text())
    assert data["source"] and data["date"]
    assert {"gpt-oss-120b", "minimax-m2.7", "qwen3-235b", "local"} <= set(table_names())
    for name in table_names():
        table = price_table(name)
        assert table.cached_input < table.input  # a cache hit must be cheaper than a prefill


def test_snapshot_prices_are_the_published_ones() -> None:
    gpt = price_table("gpt-oss-120b")
    assert (gpt.input, gpt.cached_input, gpt.output) == (0.15, 0.015, 0.60)
    minimax = price_table("MiniMax-M2.7")
    assert (minimax.input, minimax.cached_input, minimax.output) == (0.30, 0.03, 1.20)


def test_billing_rule_prefilled_input_cached_and_repos_as_hits_output() -> None:
    table = price_table("gpt-oss-120b")
    usage = _usage(prefilled=1_000_000, cached=2_000_000, repos=1_000_000, output=1_000_000)
    assert table.cost(usage) == pytest.approx(0.15 + 3 * 0.015 + 0.60)


def test_dropped_tokens_are_not_billed() -> None:
    table = price_table("qwen3-235b")
    assert table.cost(_usage(prefilled=500, cached=300, dropped=10_000)) == table.cost(_usage(prefilled=500, cached=300))


def test_unknown_table_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="expected one of .*gpt-oss-120b"):
        price_table("gpt-5")


def test_usage_from_server_fields_derives_prefilled_and_keeps_the_partition() -> None:
    usage = ReportedUsage.from_fields({"prompt_tokens": 100, "completion_tokens": 7, "cached_tokens": 60,
                               "drop_skipped_tokens": 15, "repos_tokens": 5})
    assert usage.prefilled_tokens == 20
    assert usage.prompt_tokens == (usage.prefilled_tokens + usage.cached_tokens + usage.repos_tokens
                                   + usage.drop_skipped_tokens)


def test_token_totals_sum_requests_by_class() -> None:
    totals = TokenTotals().add(_usage(prefilled=10, cached=5, output=2)).add(_usage(repos=3, dropped=4, output=1))
    assert totals.to_dict() == {"input": 10, "cached": 5, "output": 3, "drop_skipped": 4, "repos": 3}
