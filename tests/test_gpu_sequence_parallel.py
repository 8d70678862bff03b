"""Sequence parallelism on GPUs: torch's TP-tutorial plan (launch/sp_model.py) in bf16, compiled
with the pass, with the engine made to commit one of our one-launch reduce_scatter -> add +
RMSNorm -> all_gather algorithms (symm_scatter_gather, or one_shot_scatter_gather, at their full
depth) wherever it can. A training step's output and gradients against eager SP, then
reduce-overhead inference (CUDA graphs) replayed against eager.
"""

from __future__ import annotations

import copy

import pytest
import torch

from multirank import SAFE_GPU_ENV, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _error(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / (b.norm() + 1e-12))


def sp_gpu_rank(rank, world, algorithm):
    from torch.distributed.device_mesh import init_device_mesh

    import infini_dist.compile as idc
    from infini_dist.launch import sp_model
    from infini_dist.launch.bench_sp import prefer
    from infini_dist.scheduler.store import STORE
    torch.cuda.set_device(rank)
    STORE.timing_hook = prefer(algorithm)
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    full = sp_model.Model(layers=2, dim=512, hidden=1024, head_dim=64).cuda().bfloat16()
    eager = sp_model.shard(copy.deepcopy(full), mesh)
    model = sp_model.shard(copy.deepcopy(full), mesh)
    x = torch.randn(2, 64 * world, 512, device="cuda", dtype=torch.bfloat16)
    shard = x.chunk(world, dim=1)[rank].contiguous()
    grad = torch.randn_like(shard)
    results = {}
    for name, module, fn in (("eager", eager, eager),
                             ("compiled", model, idc.compile_model(model))):
        inputs = shard.clone().requires_grad_(True)
        out = fn(inputs)
        out.backward(grad)
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for p in module.parameters()]
        results[name] = (out.detach(), inputs.grad, grads)
    (out, x_grad, grads), (e_out, e_x_grad, e_grads) = results["compiled"], results["eager"]
    chosen = sorted({d["choice"] for d in idc.decisions()})
    torch._dynamo.reset()
    with torch.no_grad():
        graphed = idc.compile_model(model, mode="reduce-overhead")
        worst = 0.0
        for step in range(5):
            probe = torch.randn_like(shard)
            worst = max(worst, _error(graphed(probe).clone(), eager(probe)))
    return {"out": _error(out, e_out), "x_grad": _error(x_grad, e_x_grad),
            "grads": max(_error(g, e) for g, e in zip(grads, e_grads)), "chosen": chosen,
            "graphed": worst}


@pytest.mark.parametrize("algorithm", ["symm_scatter_gather", "one_shot_scatter_gather"])
def test_sequence_parallel_on_gpus(algorithm):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_ranks(sp_gpu_rank, 2, algorithm, backend="nccl", env=SAFE_GPU_ENV,
                        timeout=540)
    for r in results:
        assert any(c.startswith(algorithm) for c in r["chosen"]), r["chosen"]
        assert r["out"] < 2e-2 and r["x_grad"] < 2e-2 and r["grads"] < 2e-2, r
        assert r["graphed"] < 2e-2, r
    assert results[0]["chosen"] == results[1]["chosen"]
