"""The fast launch path (`nt_runtime.FastLaunch`) of the symmetric-memory runners
(`backends.symm_launch.PreparedLaunch`) and of the ninetoothed chain kernels
(`elementwise_chain.prepare`) under Triton's interpreter (CPU): the prepared launches give
bitwise the outputs of the normal path, and, the interpreter returning no CompiledKernel, every
FastLaunch falls back to the normal path for good after its first call.

Triton's real (compiling) launch path, with a stand-in driver: test_launch_fast_path_stub.py.
"""

from __future__ import annotations

import pytest
import torch

from interpreter_worker import interpreter_pool, interpreter_unusable, run
from launch_stub import SYMM_CASES, chain_cases, chain_inputs, symm_algorithm, symm_plan
from multirank import run_ranks
from symm_cases import make_inputs, max_error, reference

# ---- the interpreter: same outputs, fallback detected --------------------------------------------

def _interpreted_symm_rank(rank, world_size, storages):
    from infini_dist.scheduler.backends.symm_launch import PreparedLaunch
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    report = []
    for index, (kind, pattern, shape, dtype) in enumerate(SYMM_CASES):
        algorithm = symm_algorithm(kind)
        graph, plan = symm_plan(kind, pattern, shape, dtype, world_size, rank)
        buffer = from_peer_tensors(storages[index], rank)
        prepared = None
        for call in range(3):
            inputs = [make_inputs(graph, shape, dtype, r, call) for r in range(world_size)]
            env = inputs[rank]
            if call == 2:  # a strided source: the prepared launch hands it to the normal path
                env = dict(env, x=env["x"].t().contiguous().t())
            normal = algorithm.launch(plan, env, buffer)
            prepared = prepared or PreparedLaunch(algorithm, plan, buffer, env)
            fast = prepared(env)
            expected = reference(graph, inputs, rank)
            report.append({
                "case": (kind, pattern, shape, str(dtype), call),
                "same": sorted(normal) == sorted(fast) and all(
                    torch.equal(normal[n], fast[n]) for n in normal),
                "error": max(max_error(normal, expected), max_error(fast, expected)),
                "fast": prepared.launch.fast, "normal_only": prepared.launch.normal_only})
    return report


@pytest.mark.skipif(interpreter_unusable() is not None, reason=str(interpreter_unusable()))
def test_prepared_symm_launch_matches_the_normal_path_interpreted(monkeypatch):
    from infini_dist.kernels.symm_buffers import header_bytes
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    world_size = 2
    storages = [[torch.zeros(header_bytes(world_size) + (1 << 16), dtype=torch.uint8)
                 .share_memory_() for _ in range(world_size)] for _ in SYMM_CASES]
    per_rank = run_ranks(_interpreted_symm_rank, world_size, storages, timeout=600,
                         env={"TRITON_INTERPRET": "1"})
    for report in per_rank:
        assert len(report) == 3 * len(SYMM_CASES)
        for entry in report:
            tol = 1e-5 if "float32" in entry["case"][3] else 3e-2
            assert entry["same"], entry
            assert entry["error"] <= tol, entry
            # No CompiledKernel under the interpreter: the normal path, for good.
            assert not entry["fast"] and entry["normal_only"], entry



def _interpreted_chain_runs():
    from infini_dist.kernels.elementwise_chain import elementwise_chain, prepare
    report = []
    for chain, shapes, dtype in chain_cases():
        launch = prepare(chain, shapes, [dtype] * len(shapes))
        for call in range(4):
            inputs = chain_inputs(shapes, dtype, call)
            expected = elementwise_chain(chain, *inputs)  # a fresh prepare: the normal path
            # At the last call the first output goes into the first input, as nccl+nt does.
            outs = [inputs[0]] + [None] * (len(chain.outputs) - 1) if call == 3 else None
            got = launch(inputs, outs)
            fast = launch.state["fast"]
            report.append({"same": all(torch.equal(a, b) for a, b in zip(got, expected)),
                           "count": (len(got), len(expected)),
                           "built": bool(fast), "fast": bool(fast) and fast.fast,
                           "normal_only": bool(fast) and fast.normal_only})
    return report


@pytest.mark.skipif(interpreter_unusable() is not None, reason=str(interpreter_unusable()))
def test_chain_fast_path_matches_the_normal_path_interpreted(tmp_path):
    with interpreter_pool(str(tmp_path / "home")) as pool:
        report = run(pool, _interpreted_chain_runs, timeout=300)
    assert len(report) == 4 * len(chain_cases())
    for call, entry in enumerate(report):
        assert entry["same"] and entry["count"][0] == entry["count"][1], entry
        if call % 4 >= 1:  # built at the second call, then on the normal path for good
            assert entry["built"] and entry["normal_only"] and not entry["fast"], entry

