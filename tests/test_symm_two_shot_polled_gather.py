"""kernels/two_shot_polled_gather.py: interpreted on CPU ranks (tests/symm_runs.py), by the
engine's algorithm and by `two_shot_polled_gather_all_reduce`, also in groups of items; on GPUs
by tests/gpu_symm_worker.py."""

import pytest
import torch

from infini_dist.kernels.two_shot_polled_gather import (POLLED_GATHER,
                                                        two_shot_polled_gather_all_reduce)
from symm_runs import algorithm_of, callable_cases, run_gpu_worker, run_interpreted, standard_cases


def test_interpreted_three_ranks(monkeypatch):
    name = algorithm_of(POLLED_GATHER).name
    run_interpreted(monkeypatch, 3, standard_cases(name) +
                    callable_cases(name, two_shot_polled_gather_all_reduce))


def test_interpreted_in_groups(monkeypatch):
    # Items move in groups of 4, some groups cut short by the end of the tensor.
    monkeypatch.setenv("INFINI_DIST_SYMM_GROUP_ITEMS", "4")
    name = algorithm_of(POLLED_GATHER).name
    run_interpreted(monkeypatch, 2, [(name, pattern, shape, torch.float32) for pattern, shape in
                                     (("add_rms_norm", (300, 8)), ("prologue_gelu", (2, 4100)),
                                      ("add_then_rms_norm", (5, 37)))])


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_gpu_worker(tmp_path, "--quick", "--only", algorithm_of(POLLED_GATHER).name)
