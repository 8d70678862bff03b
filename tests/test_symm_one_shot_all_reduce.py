"""kernels/one_shot_all_reduce.py: interpreted on CPU ranks (tests/symm_runs.py), by the engine's
algorithm and by `one_shot_all_reduce`; on GPUs by tests/gpu_symm_worker.py."""

import pytest
import torch

from infini_dist.kernels.one_shot_all_reduce import ONE_SHOT, one_shot_all_reduce
from symm_runs import algorithm_of, callable_cases, run_gpu_worker, run_interpreted, standard_cases


def test_interpreted_three_ranks(monkeypatch):
    name = algorithm_of(ONE_SHOT).name
    run_interpreted(monkeypatch, 3, standard_cases(name) +
                    callable_cases(name, one_shot_all_reduce))


def test_interpreted_two_ranks(monkeypatch):
    name = algorithm_of(ONE_SHOT).name
    run_interpreted(monkeypatch, 2, [(name, pattern, (3, 48), torch.float32)
                                     for pattern in ("plain", "add_then_rms_norm", "swiglu_up")])


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_gpu_worker(tmp_path, "--quick", "--only", algorithm_of(ONE_SHOT).name)
