"""Pruning: masks and N:M patterns (:mod:`.masks`), magnitude, Wanda and SparseGPT
(:mod:`.magnitude`, :mod:`.wanda`, :mod:`.sparsegpt`, driven through the sequential calibration
engine by :mod:`.sparsify`), depth (:mod:`.depth`) and width (:mod:`.width`) pruning, and one
validated entry point for all of them (:mod:`.apply`).

Calling the package, ``llmopt.prune(model, method=..., output=...)``, runs the prune stage (:mod:`llmopt.api`).
"""

from llmopt.core.callable_module import make_callable

make_callable(__name__, "llmopt.api:prune")
