"""kernels/two_shot_all_reduce.py: interpreted on CPU ranks (tests/symm_runs.py), by the engine's
algorithm and by `two_shot_all_reduce`, also in rounds and groups of items; on GPUs by
tests/gpu_symm_worker.py."""

import pytest
import torch

from infini_dist.kernels.two_shot_all_reduce import TWO_SHOT, two_shot_all_reduce
from symm_runs import algorithm_of, callable_cases, run_gpu_worker, run_interpreted, standard_cases


def test_interpreted_three_ranks(monkeypatch):
    name = algorithm_of(TWO_SHOT).name
    run_interpreted(monkeypatch, 3, standard_cases(name) +
                    callable_cases(name, two_shot_all_reduce))


def test_interpreted_two_ranks_in_rounds(monkeypatch):
    # One item per program per round: phase 3 of a round runs beside phase 2 of the next; with
    # 300 rows on 128 programs some programs go through three rounds.
    monkeypatch.setenv("INFINI_DIST_SYMM_ROUND_ITEMS", "1")
    name = algorithm_of(TWO_SHOT).name
    cases = [(name, pattern, (3, 48), torch.float32)
             for pattern in ("plain", "add_then_rms_norm", "swiglu_up")]
    run_interpreted(monkeypatch, 2, cases + [(name, "add_rms_norm", (300, 8), torch.float32)])


def test_interpreted_in_groups_and_rounds(monkeypatch):
    # Items move in groups of 4 (some groups cut short by the end of a round or of the tensor),
    # in rounds of 3 items per program.
    monkeypatch.setenv("INFINI_DIST_SYMM_GROUP_ITEMS", "4")
    monkeypatch.setenv("INFINI_DIST_SYMM_ROUND_ITEMS", "3")
    name = algorithm_of(TWO_SHOT).name
    run_interpreted(monkeypatch, 2, [(name, pattern, shape, torch.float32) for pattern, shape in
                                     (("add_rms_norm", (300, 8)), ("prologue_gelu", (2, 4100)),
                                      ("add_then_rms_norm", (5, 37)))])


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_gpu_worker(tmp_path, "--quick", "--only", algorithm_of(TWO_SHOT).name)
