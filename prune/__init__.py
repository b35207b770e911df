"""Pruning: masks and N:M patterns (:mod:`.masks`), magnitude, Wanda and SparseGPT
(:mod:`.magnitude`, :mod:`.wanda`, :mod:`.sparsegpt`, driven through the sequential calibration
engine by :mod:`.sparsify`), depth (:mod:`.depth`) and width (:mod:`.width`) pruning, and one
validated entry point for all of them (:mod:`.apply`).

The folder is ``prune/``; it imports as ``llmopt.pruning`` so that ``llmopt.prune`` stays the
API function that runs the prune stage (:func:`llmopt.api.prune`).
"""
