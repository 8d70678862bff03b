"""The eager ops' C++ path on a GPU (kernels/express.py): once a call ran a committed
symmetric-memory choice, the same call is matched and launched from C++. Its outputs must be
bitwise those of the Python path for every kernel the engine offers, close to a float64
reference, launched from C++ (its hit counter moves), captured and replayed in a CUDA graph,
and a call with another layout must go back to the Python path and get its own record. The
compile pass's sites (torch.ops.infini_dist.fused_site) take the same path.

One GPU: the symmetric-memory kernels run at world size 1 (bench_eager.allow_one_rank);
their launches are the same at any world size. The multi-GPU engine tests
(test_gpu_engine.py) also run through this path after their first calls.
"""

import pytest
import torch

from multirank import run_ranks

CHOICES = ("one_shot", "two_shot", "one_shot_lamport", "two_shot_lamport",
           "two_shot_polled_gather", "one_shot_lamport_streamed")


def _reference(x, residual, weight):
    h = x.double() + residual.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double(), h


def express_worker(rank, world_size):
    import infini_dist
    from infini_dist import ops
    from infini_dist.kernels import express
    from infini_dist.launch.bench_eager import allow_one_rank
    from infini_dist.scheduler.store import STORE
    allow_one_rank()
    built = express.start(wait=True)
    assert built is not None, express._state["error"]
    device = torch.device("cuda", rank)
    gen = torch.Generator(device="cpu").manual_seed(5)

    def inputs(tokens):
        x, residual = (torch.randn(tokens, 4096, generator=gen).to(device, torch.bfloat16)
                       for _ in range(2))
        return x, residual, (1 + 0.1 * torch.randn(4096, generator=gen)).to(device,
                                                                           torch.bfloat16)
    report = {}
    with torch.no_grad():
        for number, name in enumerate(CHOICES):
            with infini_dist.config.patch(fusion_speedup_threshold=1.0 + 1e-6 * (1 + number)):
                STORE.timing_hook = lambda medians, p=name: {
                    n: 0.5 if n.startswith(p + "[") and n.endswith("e1]") else 2.0
                    for n in medians}
                x, residual, weight = inputs(16)
                python = ops.all_reduce_add_rms_norm(x, residual, weight)  # tunes, records
                committed = ops.decisions()[-1]["choice"]
                hits = built.hits()
                fast = ops.all_reduce_add_rms_norm(x, residual, weight)
                torch.cuda.synchronize()
                row = dict(committed=committed, hits=built.hits() - hits,
                           same=all(torch.equal(a, b) for a, b in zip(python, fast)))
                ref, h = _reference(x, residual, weight)
                row["error"] = max((fast[0].double() - ref).abs().max().item() /
                                   ref.abs().max().item(),
                                   (fast[1].double() - h).abs().max().item() /
                                   h.abs().max().item())
                # another layout: the Python path, then its own record
                y, res2, _ = inputs(3)
                before = built.hits()
                ops.all_reduce_add_rms_norm(y, res2, weight)
                second = ops.all_reduce_add_rms_norm(y, res2, weight)
                row["other_layout_hits"] = built.hits() - before
                ref2, _ = _reference(y, res2, weight)
                row["other_error"] = ((second[0].double() - ref2).abs().max() /
                                      ref2.abs().max()).item()
                # captured in a CUDA graph, replayed with fresh data in the same buffers
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                before = built.hits()
                with torch.cuda.graph(graph):
                    out, out_h = ops.all_reduce_add_rms_norm(x, residual, weight)
                row["captured_hits"] = built.hits() - before
                x.copy_(torch.randn(16, 4096, generator=gen).to(device, torch.bfloat16))
                graph.replay()
                torch.cuda.synchronize()
                ref3, h3 = _reference(x, residual, weight)
                row["replay_error"] = ((out.double() - ref3).abs().max() /
                                       ref3.abs().max()).item()
                report[name] = row
            STORE.timing_hook = None
        x, _, _ = inputs(16)
        before = built.hits()
        act = [ops.all_reduce_relu_scale(x, 0.5) for _ in range(3)]
        report["relu_scale"] = dict(
            hits=built.hits() - before, same=all(torch.equal(act[0], a) for a in act),
            error=((act[-1].double() - torch.relu(x.double()) * 0.5).abs().max()
                   / x.double().abs().max()).item())
    # Autograd calls never take the C++ path, and offering their launch again at every call
    # must not grow the table.
    with infini_dist.config.patch(fusion_speedup_threshold=1.25):
        STORE.timing_hook = lambda medians: {
            n: 0.5 if n.startswith("one_shot[") and n.endswith("e1]") else 2.0 for n in medians}
        x, residual, weight = inputs(16)
        wants = x.detach().requires_grad_()
        size, hits = built.size(), built.hits()
        for _ in range(4):
            out, _ = ops.all_reduce_add_rms_norm(wants, residual, weight)
        out.float().sum().backward()
        report["autograd"] = dict(grew=built.size() - size, hits=built.hits() - hits,
                                  grad=bool(wants.grad is not None
                                            and torch.isfinite(wants.grad).all()))
        STORE.timing_hook = None
    report["compiled"] = _compiled_sites(built, device)
    report["records"] = built.size()
    assert STORE.entries["all_reduce_add_rms_norm"].call is not None
    return report


def _compiled_sites(built, device):
    """The compile pass's sites (bench_site_host's 8-layer block) through the C++ path too."""
    import torch.distributed as dist

    import infini_dist
    import infini_dist.compile as idc
    from infini_dist.launch.bench_site_host import Block, deepest
    from infini_dist.scheduler.store import STORE
    block = Block(1024, dist.group.WORLD.group_name)
    x, residual = (torch.randn(4, 1024, device=device).bfloat16() for _ in range(2))
    row = {}
    with torch.no_grad():
        ref = block(x, residual)
        outputs = {}
        for number, express_ops in enumerate((False, True)):
            # sites without their GEMM (the flag's default): the C++ path does not take a
            # matmul prologue's site
            with infini_dist.config.patch(express_ops=express_ops, matmul_prologue=False,
                                          fusion_speedup_threshold=1.5 + number * 1e-6):
                STORE.timing_hook = deepest("one_shot")
                torch._dynamo.reset()
                compiled = idc.compile_model(block)
                for _ in range(3):
                    compiled(x, residual)
                before = built.hits()
                outputs[express_ops] = compiled(x, residual)
                torch.cuda.synchronize()
                row[f"hits_{express_ops}"] = built.hits() - before
            STORE.timing_hook = None
        row["same"] = all(torch.equal(a, b) for a, b in zip(outputs[False], outputs[True]))
        row["error"] = ((outputs[True][0].double() - ref[0].double()).norm()
                        / ref[0].double().norm()).item()
        row["choices"] = sorted({d["choice"] for d in
                                 __import__("infini_dist.compile.runtime_op",
                                            fromlist=["decisions"]).decisions()})
    return row


@pytest.mark.gpu
def test_express_path_matches_the_python_path_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (report,) = run_ranks(express_worker, 1, backend="nccl", timeout=600)
    for name in CHOICES:
        row = report[name]
        assert row["committed"].startswith(name + "["), row
        assert row["hits"] == 1 and row["same"], row
        assert row["error"] < 2e-2 and row["other_error"] < 2e-2, row
        assert row["other_layout_hits"] == 1, row
        assert row["captured_hits"] == 1 and row["replay_error"] < 2e-2, row
    assert report["autograd"]["hits"] == 0 and report["autograd"]["grew"] <= 1, report
    assert report["autograd"]["grad"], report
    compiled = report["compiled"]
    assert compiled["hits_True"] == 8 and compiled["hits_False"] == 0, compiled
    assert compiled["same"] and compiled["error"] < 2e-2, compiled
    relu = report["relu_scale"]
    assert relu["same"] and relu["error"] < 2e-2, relu
    print(report)
