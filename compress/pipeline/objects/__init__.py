"""The stages on a transformers model object in memory (``llmopt.quantize(model, tokenizer, ...)``).

Each function builds the stage's own config from the same options (so they are checked as the
CLI checks them), refuses in one line what needs a checkpoint on disk, and runs the same
algorithms on the model in place: :mod:`.quantize`, :mod:`.prune`, :mod:`.distill`, and
:mod:`.oneshot` for a recipe. What was done rides on the model
(:mod:`llmopt.checkpoints.attached`) for :func:`llmopt.save`.
"""
