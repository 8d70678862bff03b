"""The engine end to end on GPUs: eager fused ops tuned across NCCL ranks, committed, replayed.

Checks what a user relies on: results against a float64 reference built from every rank's
inputs, bitwise-identical outputs on all ranks, the GPU algorithms present among the candidates
(a broken kernel would be dropped silently otherwise), a subgroup that is not WORLD, fp32 weights
with bf16 activations, and 10,000 CUDA-graph replays of committed choices.
"""

import hashlib

import pytest
import torch

from multirank import run_ranks

GPU_ALGORITHMS = ("one_shot", "two_shot", "one_shot_lamport", "two_shot_lamport",
                  "one_shot_lamport_streamed", "nccl+nt_epilogue")


def gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def partial(rank, shape, salt, device):
    gen = torch.Generator().manual_seed(salt * 1000 + rank)
    return torch.randn(*shape, generator=gen).to(device)


def shared(shape, salt, device):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(99_000 + salt)).to(device)


def digest(t):
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy()).hexdigest()


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_case(rank, ranks, tokens, hidden, weight_dtype, group, device):
    from infini_dist import ops
    dtype = torch.bfloat16
    shape = (tokens, hidden)
    salt = tokens * 7 + hidden
    x = partial(rank, shape, salt, device).to(dtype)
    residual = shared(shape, salt + 1, device).to(dtype)
    weight = (shared((hidden,), salt + 2, device).abs() + 0.5).to(weight_dtype)
    gate, up = partial(rank, shape, salt + 3, device).to(dtype), partial(rank, shape, salt + 4,
                                                                          device).to(dtype)
    out, res_out = ops.all_reduce_add_rms_norm(x, residual, weight, group=group)
    act = ops.all_reduce_relu_scale(x, 0.5, group=group)
    glu = ops.all_reduce_swiglu(gate, up, group=group)

    total = sum(partial(r, shape, salt, device).to(dtype).double() for r in ranks)
    h = total + residual.double()
    norm = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    g = sum(partial(r, shape, salt + 3, device).to(dtype).double() for r in ranks)
    u = sum(partial(r, shape, salt + 4, device).to(dtype).double() for r in ranks)
    refs = {"norm": norm, "residual": h, "relu_scale": torch.relu(total) * 0.5,
            "swiglu": torch.nn.functional.silu(g) * u}
    outs = {"norm": out, "residual": res_out, "relu_scale": act, "swiglu": glu}
    return {name: (relative_error(outs[name], refs[name]), digest(outs[name]))
            for name in refs}


def gpu_engine_worker(rank, world_size, subgroup_ranks):
    import torch.distributed as dist

    import infini_dist
    from infini_dist import ops
    device = torch.device("cuda", rank)
    results = {"cases": {}, "decisions": None}
    with infini_dist.config.patch(benchmark_reps=20, benchmark_warmup=5):
        everyone = list(range(world_size))
        for tokens, hidden in [(1, 4096), (3, 4096), (8192, 4096), (1, 5120), (3, 5120),
                               (1, 4100), (3, 4100)]:
            results["cases"][(tokens, hidden, "bf16")] = check_case(
                rank, everyone, tokens, hidden, torch.bfloat16, None, device)
        results["cases"][(16, 4096, "fp32-weight")] = check_case(
            rank, everyone, 16, 4096, torch.float32, None, device)
        results["decisions"] = sorted((d["op"], d["choice"], tuple(d["candidates"]))
                                      for d in ops.decisions())
        if world_size >= 4:
            # Two subgroups that are not WORLD, tuning at the same time on their own ranks.
            others = [r for r in everyone if r not in subgroup_ranks]
            groups = {tuple(subgroup_ranks): dist.new_group(subgroup_ranks),
                      tuple(others): dist.new_group(others)}
            mine = tuple(subgroup_ranks) if rank in subgroup_ranks else tuple(others)
            group = groups[mine]
            results["subgroup"] = check_case(dist.get_rank(group), list(range(len(mine))), 5,
                                             4096, torch.bfloat16, group, device)
        results["replay"] = graph_replays(rank, world_size, device)
    dist.barrier()
    return results


def graph_replays(rank, world_size, device, replays=10_000):
    """Capture the committed choices in one CUDA graph and replay it; check it now and then."""
    from infini_dist import ops
    shape = (4, 4096)
    x = partial(rank, shape, 1, device).to(torch.bfloat16)
    residual = shared(shape, 2, device).to(torch.bfloat16)
    weight = (shared((4096,), 3, device).abs() + 0.5).to(torch.bfloat16)
    ops.all_reduce_add_rms_norm(x, residual, weight)  # decide before capture
    ops.all_reduce_relu_scale(x, 0.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res_out = ops.all_reduce_add_rms_norm(x, residual, weight)
        act = ops.all_reduce_relu_scale(out, 0.5)
    worst = 0.0
    for step in range(replays):
        if step % 2500 == 0:  # fresh data through the same captured buffers
            x.copy_(partial(rank, shape, 100 + step, device).to(torch.bfloat16))
        graph.replay()
        if step % 2500 == 2499:
            torch.cuda.synchronize()
            total = sum(partial(r, shape, 100 + step - 2499, device).to(torch.bfloat16).double()
                        for r in range(world_size))
            h = total + residual.double()
            norm = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
            worst = max(worst, relative_error(out, norm), relative_error(res_out, h))
    torch.cuda.synchronize()
    return {"worst": worst, "digest": digest(act)}


def check_results(results, world_size):
    tol = 2e-2  # bf16 output, one rounding per element
    for key in results[0]["cases"]:
        for name, (error, _) in results[0]["cases"][key].items():
            assert error < tol, (key, name, error)
        for name in results[0]["cases"][key]:
            digests = {r["cases"][key][name][1] for r in results}
            assert len(digests) == 1, f"{key} {name}: outputs differ across ranks"
    decisions = results[0]["decisions"]
    assert decisions == results[-1]["decisions"]
    candidates = {c for _, _, cands in decisions for c in cands}
    for algorithm in GPU_ALGORITHMS:
        assert any(c.startswith(algorithm + "[") or f"+{algorithm}" in c
                   for c in candidates), (
            algorithm, sorted(candidates))
    for r in results:
        assert r["replay"]["worst"] < tol
    assert len({r["replay"]["digest"] for r in results}) == 1


@pytest.mark.multigpu
@pytest.mark.parametrize("world_size", [2, 4])
def test_engine_on_gpus(world_size):
    if gpus() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    results = run_ranks(gpu_engine_worker, world_size, [0, world_size - 1], backend="nccl",
                        timeout=540)
    check_results(results, world_size)
    for r in results:
        if "subgroup" in r:
            for name, (error, _) in r["subgroup"].items():
                assert error < 2e-2, (name, error)
