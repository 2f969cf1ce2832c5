"""The execution of runs: the harness drives an agent through a task under a policy and a backend
(`harness`), tasks run side by side in lanes (`lanes`), each request is recorded (`trajectory`)
and billed (`cost`, `prices.json`); text edits get their summaries (`summarize`), the hindsight
oracle replays recorded actions (`oracle`) and `progress` shows how far a run has come."""
