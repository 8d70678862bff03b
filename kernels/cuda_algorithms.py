"""Registers the GPU algorithms for all_reduce sites; the engine imports this on first CUDA use.

Each backend is optional: one whose module fails to import (no ninetoothed, an old Triton) is left
out with a warning, and the engine still has the native NCCL path and the other backends.
"""

import importlib
import logging

from infini_dist.scheduler.choices import register_algorithm

log = logging.getLogger("infini_dist")

_BACKENDS = (
    ("infini_dist.kernels.nccl_epilogue", "NcclEpilogueAlgorithm"),
    ("infini_dist.kernels.symm_algorithms", "OneShotAllReduce"),
    ("infini_dist.kernels.symm_algorithms", "TwoShotAllReduce"),
    ("infini_dist.kernels.symm_algorithms", "LamportOneShotAllReduce"),
    ("infini_dist.kernels.symm_algorithms", "LamportTwoShotAllReduce"),
    ("infini_dist.kernels.symm_algorithms", "PolledGatherTwoShotAllReduce"),
)

for module_name, class_name in _BACKENDS:
    try:
        algorithm = getattr(importlib.import_module(module_name), class_name)()
    except Exception as error:  # noqa: BLE001 - a missing backend must not break the others
        log.warning("infini_dist: GPU algorithm %s.%s unavailable: %s", module_name, class_name,
                    error)
        continue
    register_algorithm("all_reduce", "cuda", algorithm)
