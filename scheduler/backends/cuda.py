"""Registers the GPU algorithms for collective sites; the engine imports this on first CUDA use.

Each backend is optional: one whose module fails to import (no ninetoothed, an old Triton) is left
out with a warning, and the engine still has the native NCCL path and the other backends.
"""

import logging

from infini_dist.scheduler.choices import register_algorithm

log = logging.getLogger("infini_dist")


def _nccl_epilogue():
    from infini_dist.scheduler.backends.nccl_epilogue import NcclEpilogueAlgorithm
    return [("all_reduce", NcclEpilogueAlgorithm())]


def _symm():
    from infini_dist.scheduler.backends.symm import algorithms
    return [("all_reduce", algorithm) for algorithm in algorithms()]


def _symm_scatter():
    from infini_dist.scheduler.backends.symm_scatter import (OneShotScatterGather,
                                                              SymmScatterGather)
    return [("reduce_scatter", SymmScatterGather()), ("reduce_scatter", OneShotScatterGather())]


def _symm_gather():
    from infini_dist.scheduler.backends.symm_gather import LamportAllGather
    return [("all_gather", LamportAllGather())]


def _matmul():
    """Spans starting with the matmul that feeds the all_reduce (config.matmul_prologue)."""
    from infini_dist.scheduler.backends import symm_chunked
    from infini_dist.scheduler.backends.symm_gemm import GemmOneShot
    from infini_dist.scheduler.backends.torch_mm_rs import TorchMatmulReduceScatter
    return [("all_reduce", GemmOneShot()), ("all_reduce", TorchMatmulReduceScatter())] + [
        ("all_reduce", split) for split in symm_chunked.algorithms()]


def _overlap():
    """Sites with work beside their all_reduce (the "overlap" fusion type)."""
    from infini_dist.scheduler.backends.symm_overlap import algorithms
    return [("all_reduce", algorithm) for algorithm in algorithms()]


for backend in (_nccl_epilogue, _symm, _symm_scatter, _symm_gather, _matmul, _overlap):
    try:
        algorithms = backend()
    except Exception as error:  # noqa: BLE001 - a missing backend must not break the others
        log.warning("infini_dist: GPU backend %s unavailable: %s", backend.__name__.strip("_"),
                    error)
        continue
    for op_type, algorithm in algorithms:
        register_algorithm(op_type, "cuda", algorithm)
