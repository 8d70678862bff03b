"""kernels/two_shot_all_reduce.py, interpreted on CPU ranks by its engine algorithm and as a
plain callable, also in rounds and groups of items, and on GPUs (tests/symm_runs.py)."""

import pytest

from infini_dist.kernels.two_shot_all_reduce import two_shot_all_reduce
from symm_cases import TRAIN
from symm_runs import run_cases, run_on_gpus, run_standard, run_with_a_late_rank


def test_interpreted_three_ranks(monkeypatch):
    run_standard(monkeypatch, two_shot_all_reduce)


def test_interpreted_two_ranks_in_rounds(monkeypatch):
    # One item per program per round: phase 3 of a round runs beside phase 2 of the next; with
    # 300 rows on 128 programs some programs go through three rounds.
    monkeypatch.setenv("INFINI_DIST_SYMM_ROUND_ITEMS", "1")
    run_cases(monkeypatch, two_shot_all_reduce, 2, [
        ("plain", (3, 48)), ("add_then_rms_norm", (3, 48)), ("swiglu_up", (3, 48)),
        ("add_rms_norm", (300, 8))])


def test_interpreted_in_groups_and_rounds(monkeypatch):
    # Items move in groups of 4 (some groups cut short by the end of a round or of the tensor),
    # in rounds of 3 items per program.
    monkeypatch.setenv("INFINI_DIST_SYMM_GROUP_ITEMS", "4")
    monkeypatch.setenv("INFINI_DIST_SYMM_ROUND_ITEMS", "3")
    run_cases(monkeypatch, two_shot_all_reduce, 2, [
        ("add_rms_norm", (300, 8)), ("prologue_gelu", (2, 4100)), ("add_then_rms_norm", (5, 37)),
        (TRAIN, (300, 8))])  # an rsqrt per row of a group


def test_a_late_rank_keeps_its_output_when_peers_start_a_bigger_call(monkeypatch):
    # The gathered copy a late rank still reads sits at a fixed offset, never under the next
    # call's staging (placed after the staging of each shape, 94 of 120 elements went wrong).
    run_with_a_late_rank(monkeypatch, two_shot_all_reduce)


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_on_gpus(tmp_path, two_shot_all_reduce)
