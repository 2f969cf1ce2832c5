"""Statistics over paired task results: intervals and tests (`paired`), and the champion rule
(`champion`). Imports nothing of ours (numpy only), so the sandbox, evolution and the benchmarks
all share the one copy."""
