"""kernels/lamport_two_shot.py, interpreted on CPU ranks by its engine algorithm and as a plain
callable (every polled place emptied after each call), and on GPUs (tests/symm_runs.py)."""

import pytest

from infini_dist.kernels.lamport_two_shot import lamport_two_shot_all_reduce as kernel
from symm_runs import run_cases, run_on_gpus, run_standard


def test_interpreted_three_ranks(monkeypatch):
    run_standard(monkeypatch, kernel, all_polled=True)


def test_interpreted_two_ranks_many_items(monkeypatch):
    # Several items per program in every phase (phase 3 polls them one at a time), rows and
    # chunks, each call emptying what it read.
    run_cases(monkeypatch, kernel, 2, [("add_rms_norm", (300, 8)), ("prologue_gelu", (2, 4100))],
              all_polled=True)


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_on_gpus(tmp_path, kernel)
