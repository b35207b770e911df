"""Distillation: teacher → student with logit and hidden-state losses, resumable, data-parallel.

- :mod:`.losses` — forward / reverse KL, generalized JSD (temperature, T² scaling), hidden-state
  MSE with a layer map, cross-entropy
- :mod:`.data` — text → packed fixed-length sequences; the seeded, resumable sample order
- :mod:`.teacher_cache` — the teacher's top-k log-probabilities cached on disk
- :mod:`.student` — students: given, or the teacher with blocks dropped / width pruned
- :mod:`.trainer` — the accelerate training loop (checkpoints, Ctrl-C, validation, live display)
- :mod:`.run` — one run end to end (``run_distill``), used by ``llmopt distill``

Calling the package, ``llmopt.distill(teacher, steps=..., output=...)``, runs the distill stage (:mod:`llmopt.api`).
"""

from llmopt.core.callable_module import make_callable

make_callable(__name__, "llmopt.api:distill")
