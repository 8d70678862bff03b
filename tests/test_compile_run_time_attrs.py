"""Attributes a graph reads at run time (compile/fx_patterns.RunTimeScalar,
scheduler/run_time_attrs.py). Under torch.compile(dynamic=True) Dynamo makes a module's float
attribute (HF's `self.variance_epsilon`, a `self.scale`) a 0-dim CPU graph input, so the norm's
`+ eps` and the `* scale` read a tensor, not a constant. The site takes them as run-time values:
it fuses as with a constant, follows a changed attribute without recompiling, and past
MAX_VALUES values runs eagerly. On 2 gloo ranks, bf16 (in fp32 a CPU graph's `* scale` is a
plain `mul` of a 0-dim tensor, which needs no attribute), against fp64."""

from __future__ import annotations

import torch

from multirank import run_ranks
from test_compile_tp import _env

HIDDEN = 16


class Block(torch.nn.Module):
    """A row-parallel output reduced, the residual added, HF's RMSNorm spelling (eps a float
    attribute), and a side output scaled by a float attribute."""

    def __init__(self, group_name: str):
        super().__init__()
        self.group_name = group_name
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.variance_epsilon = 1e-6
        self.scale = 0.5

    def forward(self, x, residual):
        import torch.distributed._functional_collectives as funcol
        out = funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group_name)) + residual
        h = out.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(out.dtype), torch.relu(out) * self.scale


def _inputs(rank: int, tokens: int):
    gen = torch.Generator().manual_seed(100 * tokens + rank)
    # small rows, so that the eps shows in the norm
    x = 1e-2 * torch.randn(2, tokens, HIDDEN, generator=gen)
    shared = torch.Generator().manual_seed(tokens)  # the residual is every rank's
    residual = 1e-2 * torch.randn(2, tokens, HIDDEN, generator=shared)
    return x.to(torch.bfloat16), residual.to(torch.bfloat16)


def _reference(block, world, tokens, eps, scale):
    """The block in fp64 from every rank's inputs."""
    out = sum(_inputs(r, tokens)[0].double() for r in range(world)) + \
        _inputs(0, tokens)[1].double()
    h = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return block.weight.double() * h, torch.relu(out) * scale


def _error(got, want) -> float:
    return max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


def run_time_rank(rank, world):
    import torch.distributed as dist

    import infini_dist.compile as idc
    from infini_dist.scheduler import run_time_attrs
    from infini_dist.scheduler.store import STORE
    torch.manual_seed(0)
    block = Block(dist.group.WORLD.group_name).to(torch.bfloat16)
    run_time_attrs.MAX_VALUES = 2  # the third pair of values runs eagerly
    compiled = idc.compile_model(block, backend="infini_dist", dynamic=True)
    rows = []
    with torch.no_grad(), idc.recording() as graphs:
        # (tokens, eps, scale): a new count, then the attributes changed twice
        for tokens, eps, scale in ((4, 1e-6, 0.5), (6, 1e-6, 0.5), (5, 1e-2, 0.25),
                                   (3, 1e-3, 2.0)):
            block.variance_epsilon, block.scale = eps, scale
            got = compiled(*_inputs(rank, tokens))
            rows.append({"error": _error(got, _reference(block, world, tokens, eps, scale)),
                         "from_stale": _error(got, _reference(block, world, tokens, 1e-6, 0.5)),
                         "outs": got})
    return {"rows": rows, "sites": [g.site_ops() for g in graphs],
            "bound": [sorted(values) for values in STORE.bound.values()]}


def test_attributes_read_at_run_time_fuse_and_follow_their_changes():
    results = run_ranks(run_time_rank, 2, env=_env(), timeout=300)
    for r in results:
        # one graph for every count and value; the scale and the norm in its site
        assert r["sites"] == [[["all_reduce", "add_rms_norm", "relu", "scale"]]], r["sites"]
        for row in r["rows"]:
            assert row["error"] < 2e-2, r["rows"]  # bf16
        # the site met two pairs of (eps, scale), the floats themselves (not their fp32
        # casts: the texts a constant makes); the third ran eagerly, and as right
        (values,) = r["bound"]
        assert values == [(1e-6, 0.5), (1e-2, 0.25)], values
    # the changed attributes changed the outputs, which a value fixed at compile time misses
    assert all(row["from_stale"] > 0.1 for row in results[0]["rows"][2:]), results[0]["rows"]
    for a, b in zip(results[0]["rows"], results[1]["rows"]):
        for x, y in zip(a["outs"], b["outs"]):
            assert torch.equal(x, y)


def test_the_pass_writes_the_scalar_and_its_slot():
    from fx_graphs import ar, export, fuse, llama_norm, ops_of, rand

    def f(x, residual, w, eps):  # eps a 0-dim CPU tensor, as Dynamo hands a float over
        out = ar(x) + residual
        return llama_norm(out, w, eps), out

    from infini_dist.scheduler import run_time_attrs
    inputs = (rand(4, HIDDEN), rand(4, HIDDEN, seed=1), rand(HIDDEN, seed=2),
              torch.tensor(1e-6, dtype=torch.float64))
    gm = export(f, *inputs)
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce", "add_rms_norm"]
    (call,) = [n for n in gm.graph.nodes
               if n.target is torch.ops.infini_dist.fused_site_scalars.default]
    tensors, scalars, text, slots = call.args
    assert len(tensors) == 3 and slots == ["1:eps"]
    (scalar,) = scalars
    assert scalar.op == "placeholder"  # the float itself, not its cast to fp32
    # with the value in its slot, the site is the one a constant eps makes: one set of decisions
    static = export(lambda x, residual, w: f(x, residual, w, 1e-6), *inputs[:3])
    (constant,) = fuse(static)
    assert run_time_attrs.substitute(text, tuple(slots), (1e-6,)) == constant


def test_under_cuda_graphs_the_site_stops_before_a_run_time_attribute():
    """With CUDA graphs and graph partitions Inductor moves CPU scalar inputs to the GPU, where
    a site could not read them during a capture: the norm stays Inductor's."""
    import torch._inductor.config as inductor_config
    from fx_graphs import FUSED, ar, export, fuse, llama_norm, ops_of, rand

    def f(x, residual, w, eps):
        out = ar(x) + residual
        return llama_norm(out, w, eps), out

    eps = torch.tensor(1e-6, dtype=torch.float64)
    gm = export(f, rand(4, HIDDEN), rand(4, HIDDEN, seed=1), rand(HIDDEN, seed=2), eps)
    with inductor_config.patch({"triton.cudagraphs": True, "graph_partition": True}):
        (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce", "add"]
    assert [n.target for n in gm.graph.nodes].count(FUSED) == 1


def test_a_scalar_computed_from_the_site_is_no_attribute():
    from fx_graphs import FUSED, ar, export, fuse, ops_of, rand

    def f(x):  # on gloo the mean is a 0-dim CPU tensor too, read after the all_reduce: the
        # site would have to run before its own input (matching._fits keeps it out)
        out = ar(x)
        return torch.relu(out) * out.mean()

    gm = export(f, rand(4, HIDDEN))
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce", "relu"]
    assert [n.target for n in gm.graph.nodes].count(FUSED) == 1


def test_substitute_fills_the_slots_and_checks_their_count():
    import math

    import pytest

    from infini_dist.ops import add_rms_norm_graph
    from infini_dist.scheduler import run_time_attrs
    graph = add_rms_norm_graph(math.nan)
    index = next(i for i, n in enumerate(graph.nodes) if n.attr("eps") is not None)
    filled = run_time_attrs.substitute(graph.canonical(), (f"{index}:eps",), (1e-5,))
    assert filled.nodes[index].attr("eps") == 1e-5
    assert filled == add_rms_norm_graph(1e-5)
    with pytest.raises(ValueError, match="1 slots, 2 values"):
        run_time_attrs.substitute(graph.canonical(), (f"{index}:eps",), (1e-5, 2.0))


def test_a_cpu_scalar_beside_gpu_tensors_is_an_attribute_not_an_operand():
    """On a CPU graph `x * s` with s a 0-dim tensor is the plain `mul`; on a GPU graph a kernel
    could not read the CPU tensor, so s is the `scale` attribute, read at run time."""
    from fx_graphs import ar, export, fuse, ops_of, rand
    from test_compile_matmul_prologue import _on_cuda

    def f(x, s):
        return torch.relu(ar(x)) * s

    args = (rand(4, HIDDEN), torch.tensor(0.5))
    (on_cpu,) = fuse(export(f, *args))
    assert ops_of(on_cpu) == ["all_reduce", "relu", "mul"]
    gm = export(f, *args)
    scalar = [n.name for n in gm.graph.nodes if n.op == "placeholder"][1]
    (on_gpu,) = fuse(_on_cuda(gm, keep_on_cpu=(scalar,)))
    assert ops_of(on_gpu) == ["all_reduce", "relu", "scale"]
    (call,) = [n for n in gm.graph.nodes
               if n.target is torch.ops.infini_dist.fused_site_scalars.default]
    assert [s.name for s in call.args[1]] == [scalar]
