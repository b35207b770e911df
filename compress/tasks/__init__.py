"""Task accuracy through lm-evaluation-harness: the adapter (:mod:`.harness_model`), scoring
with standard errors and baseline differences (:mod:`.scores`), and tiny offline tasks (``data/``).

It sits beside the algorithms (below the stages), so the eval stage can score tasks."""
