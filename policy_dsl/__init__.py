"""policy_dsl: the cache-policy language of AKV and its compiler.

    ast = parse(text, filename="p.akvp")      # PolicyError on any problem, with file, line, column
    text = format_policy(ast)                  # canonical text; parse(format_policy(a)) == a
    key = canonical_hash(ast)
    policy = compile_policy(ast, name="mine")  # or load_policy("expert") / load_policy("p.akvp")
    decision = policy.decide(history, counter)
    decision.api_fields()                      # {"drop_message": ..., "reposition": ...}
    lark_text = constrained_grammar()          # the grammar a constrained sampler writes policies under

The language is documented in docs/policy-dsl.md.
"""
from policy_dsl.constrained import constrained_grammar
from policy_dsl.counter import ApproxTokenCounter, TokenCounter
from policy_dsl.decision import OMITTED_PREFIX, SUMMARY_PREFIX, Decision, TextEdit, apply_text_edits
from policy_dsl.errors import PolicyError, PolicyLimitError, PolicySyntaxError, PolicyValidationError
from policy_dsl.history import DROP_CONTEXT_TOOL, HistoryError
from policy_dsl.library import builtin_names, builtin_source, load_policy
from policy_dsl.parser import parse
from policy_dsl.policy import CachePolicy, compile_policy
from policy_dsl.printer import canonical_hash, format_policy
from policy_dsl.tunables import Tunable, tunables, with_tunables, without_ranges
from policy_dsl.validator import validate

__all__ = [
    "ApproxTokenCounter", "CachePolicy", "DROP_CONTEXT_TOOL", "Decision", "HistoryError", "OMITTED_PREFIX",
    "PolicyError", "PolicyLimitError", "PolicySyntaxError", "PolicyValidationError", "SUMMARY_PREFIX",
    "TextEdit", "TokenCounter", "Tunable", "apply_text_edits", "builtin_names", "builtin_source",
    "canonical_hash", "compile_policy", "constrained_grammar", "format_policy", "load_policy", "parse",
    "tunables", "validate", "with_tunables", "without_ranges",
]
