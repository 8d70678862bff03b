"""The engine: IR, boundaries, choice generation, cross-rank benchmark, commit and cache.

Nothing is imported here: `infini_dist.scheduler.<module>` loads that module and what it imports,
no more. Backends register their algorithms when their device is first seen (choices.py).
"""
