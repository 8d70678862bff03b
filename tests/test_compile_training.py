"""Training forward graphs keep the norm's rsqrt for backward: a site exposes it as an rms_rstd
op beside add_rms_norm, and gives the norm up whole when the rsqrt cannot be exposed."""

from __future__ import annotations

import pytest
import torch

from infini_dist.scheduler import op_registry
from fx_graphs import FUSED, ar, export, fuse, ops_of, rand


def _norm_keeping_rsqrt(h, w, eps):
    h32 = h.float()
    rstd = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return w * (h32 * rstd).to(h.dtype), rstd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("depth", [1, 3])
def test_saved_rsqrt_becomes_rms_rstd_beside_add_rms_norm(dtype, depth):
    def f(x, residual, w):
        h = ar(x) + residual
        out, rstd = _norm_keeping_rsqrt(h, w, 1e-5)
        return out, h, rstd
    gm = export(f, rand(2, 4, 16, dtype=dtype), rand(2, 4, 16, dtype=dtype, seed=1),
                rand(16, dtype=dtype, seed=2))
    (sub,) = fuse(gm, max_fusion_depth=depth)  # the exposed value does not count as depth
    assert ops_of(sub) == ["all_reduce", "add_rms_norm", "rms_rstd"]
    _, norm, rstd = sub.nodes
    assert rstd.inputs == (norm.outputs[1],) and rstd.attr("eps") == pytest.approx(1e-5, rel=1e-6)
    assert set(sub.output_names) == {*norm.outputs, *rstd.outputs}
    fused = [n for n in gm.graph.nodes if n.target is FUSED]
    assert len(fused) == 1 and not any(n.target is torch.ops.aten.rsqrt.default
                                       for n in gm.graph.nodes)


@pytest.mark.parametrize("keep_reduced", [False, True])
def test_training_site_is_one_launch_of_each_symm_kernel(keep_reduced):
    """The site the pass makes of a training forward is planned whole by every symmetric-memory
    kernel: the rsqrt, and where the graph keeps it (after attention) the all_reduce's own value,
    written by the one launch (planned for 2 GPUs; the kernels run in tests/test_symm_*.py)."""
    from infini_dist.scheduler.backends.symm import plan_span
    from infini_dist.scheduler.choices import RunContext
    from infini_dist.scheduler.boundary import find_sites
    from infini_dist.scheduler.shapes import site_meta
    from symm_cases import full_span
    from symm_runs import symm_algorithms

    def f(x, residual, w):
        y = ar(x)
        h = y + residual
        out, rstd = _norm_keeping_rsqrt(h, w, 1e-5)
        return (out, h, rstd, y) if keep_reduced else (out, h, rstd)
    args = (rand(2, 4, 16, dtype=torch.bfloat16), rand(2, 4, 16, dtype=torch.bfloat16, seed=1),
            rand(16, dtype=torch.bfloat16, seed=2))
    gm = export(f, *args)
    (sub,) = fuse(gm)
    assert len(sub.output_names) == 3 + keep_reduced
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (site_node,) = [n for n in gm.graph.nodes if n.target is FUSED]
    values = {name: args[placeholders.index(node)]
              for name, node in zip(sub.input_names, site_node.args[0])}
    cuda = torch.device("cuda", 0)
    meta = {n: m._replace(device=cuda) for n, m in site_meta(
        sub, find_sites(sub)[0].region, values, torch.device("cpu")).items()}
    ctx = RunContext(None, 2, 0, cuda)
    plan = plan_span(full_span(sub), meta, ctx)
    assert plan is not None and plan.writes == ("out", "pre", "rstd") + ("reduced",) * keep_reduced
    assert all(a.supports(full_span(sub), meta, ctx) for a in symm_algorithms().values())


def test_rms_rstd_reference_is_the_fp32_rsqrt():
    x = rand(3, 8, dtype=torch.bfloat16)
    (got,) = op_registry.run_node("rms_rstd", [x], {"eps": 1e-5})
    want = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert got.dtype == torch.float32 and got.shape == (3, 1)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_rsqrt_read_before_the_norm_ends_drops_the_norm_whole():
    def f(x, residual, w):
        h = ar(x) + residual
        h32 = h.float()
        rstd = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)
        early = rstd * 2.0  # read before the norm's last node: the site cannot end after it
        return w * (h32 * rstd).to(h.dtype) + early, h
    gm = export(f, rand(2, 4, 16), rand(2, 4, 16, seed=1), rand(16, seed=2))
    (sub,) = fuse(gm)
    # add_rms_norm goes as one op (the folded add with it), and its exposed rsqrt with it.
    assert ops_of(sub) == ["all_reduce"]
    gm.graph.lint()
    assert sum(n.target is torch.ops.aten.rsqrt.default for n in gm.graph.nodes) == 1


def _train_step(rank, world, tokens, hidden, device_type="cuda"):
    """One forward and backward of bench --train's TP decoder (bf16 on cuda:rank, fp32 on CPU),
    eager and through the pass: (loss, grads) of each, and the pass's forward sites' decisions."""
    import torch.distributed as dist

    import infini_dist.compile as idc
    from infini_dist.launch.bench_train import TrainDecoder
    from infini_dist.launch.tp_decoder import ModelConfig
    from symm_cases import RSTD
    from test_compile_tp import _one_compile_thread
    _one_compile_thread()
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = ModelConfig(layers=2, hidden=hidden, mlp=2 * hidden, heads=8, kv_heads=4,
                      context=tokens)
    x = rand(1, tokens, hidden, seed=3).to(device, dtype)
    runs = []
    for compiled in (False, True):
        model = TrainDecoder(cfg, dist.group.WORLD, device, dtype)  # seeded: same weights
        loss = (idc.compile_model(model) if compiled else model)(x).float().pow(2).mean()
        loss.backward()
        runs.append((loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}))
    return runs, [d for d in idc.decisions() if d["op"].endswith(RSTD)]


@pytest.mark.multigpu
def test_training_step_on_gpus_offers_the_whole_forward_site_to_every_symm_kernel():
    from multirank import run_ranks
    from symm_runs import symm_algorithms
    from test_compile_tp import _env
    results = run_ranks(_train_step, 2, 256, 1024, backend="nccl", env=_env(),
                        timeout=500)
    symm = tuple(symm_algorithms())
    for (eager_loss, eager), (loss, grads) in (runs for runs, _ in results):
        assert loss == pytest.approx(eager_loss, rel=2e-2)
        for name, want in eager.items():
            error = float((grads[name] - want).norm() / want.norm().clamp_min(1e-30))
            assert error < 5e-2, name
    for _, sites in results:
        # Forward sites all_reduce -> add_rms_norm -> rms_rstd (after attention also keeping
        # the all_reduce's value): a symm kernel running all of it survived the checks.
        assert sites and all(any(c.startswith(symm) and c.endswith(",e2]")
                                 for c in s["candidates"]) for s in sites), sites
    assert results[0][1] and [s["choice"] for s in results[0][1]] == [
        s["choice"] for s in results[1][1]]
