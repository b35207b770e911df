"""Distillation: teacher → student with logit and hidden-state losses, resumable, data-parallel.

- :mod:`.losses` — forward / reverse KL, generalized JSD (temperature, T² scaling), hidden-state
  MSE with a layer map, cross-entropy
- :mod:`.data` — text → packed fixed-length sequences; the seeded, resumable sample order
- :mod:`.teacher_cache` — the teacher's top-k log-probabilities cached on disk
- :mod:`.student` — students: given, or the teacher with blocks dropped / width pruned
- :mod:`.trainer` — the accelerate training loop (checkpoints, Ctrl-C, validation, live display)
- :mod:`.run` — one run end to end (``run_distill``), used by ``llmopt distill``

The folder is ``distill/``; it imports as ``llmopt.distillation`` so that ``llmopt.distill``
stays the API function that runs the distill stage (:func:`llmopt.api.distill`).
"""
