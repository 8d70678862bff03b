"""kernels/lamport_one_shot.py: interpreted on CPU ranks (tests/symm_runs.py), by the engine's
algorithm and by `lamport_one_shot_all_reduce`, every polled place emptied after each call; on
GPUs by tests/gpu_symm_worker.py."""

import pytest

from infini_dist.kernels.lamport_one_shot import LAMPORT_ONE_SHOT, lamport_one_shot_all_reduce
from symm_runs import algorithm_of, callable_cases, run_gpu_worker, run_interpreted, standard_cases


def test_interpreted_three_ranks(monkeypatch):
    name = algorithm_of(LAMPORT_ONE_SHOT).name
    run_interpreted(monkeypatch, 3, standard_cases(name) +
                    callable_cases(name, lamport_one_shot_all_reduce), all_polled=True)


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_gpu_worker(tmp_path, "--quick", "--only", algorithm_of(LAMPORT_ONE_SHOT).name)
