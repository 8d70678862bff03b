"""What each epilogue op's own test (tests/test_op_<name>.py) checks, for any op spec:

- its reference (and its native implementation) against an fp64 formula written out in the test;
- its ninetoothed chain (the generic path: NCCL then one chain kernel) on Triton's interpreter
  (conftest's `pool`);
- its symmetric-memory fusion: the spec-derived symm_cases pattern on interpreted ranks;
- its FX spelling, matched by the compile pass into an all_reduce site.
"""

from __future__ import annotations

import torch

from infini_dist.kernels.chain import chain_from_nodes
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.choices import RunContext, run_nodes
from infini_dist.scheduler.ir import SubGraph
from interpreter_worker import call_kernel, run
from symm_cases import full_span, meta_of
from symm_runs import F32, BF16, run_interpreted, symm_algorithms

CPU = RunContext(None, 1, 0, torch.device("cpu"))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def randn(shape, seed, dtype=torch.float32, offset=0.0):
    """Never zeros: standard normal, shifted by `offset`."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) + offset).to(dtype)


def check_reference(op: str, inputs: list, expected64: torch.Tensor, attrs: dict) -> None:
    """The registry's reference within the dtype's tolerance of the fp64 value rounded once;
    its native implementation too (it rounds more often, so the input dtype's tolerance)."""
    dtype = inputs[0].dtype
    (got,) = op_registry.run_node(op, inputs, attrs)
    assert got.dtype == dtype and got.shape == expected64.shape
    assert op_registry.close_enough(got, expected64.to(dtype)), (op, dtype)
    assert torch.allclose(got.double(), expected64, rtol=0, atol=_ulps(dtype) * (
        1 + expected64.abs().max().item())), (op, dtype)
    (native,) = op_registry.run_node(op, inputs, attrs, native=True)
    assert op_registry.close_enough(native, got, computed_in=dtype), (op, dtype)


def _ulps(dtype) -> float:
    return {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -9,
            torch.float8_e4m3fn: 2.0 ** -3}[dtype]


def unfused(nodes, inputs, outputs, tensors) -> list:
    graph = SubGraph(tuple(nodes), tuple(inputs), tuple(outputs))
    env = dict(zip(inputs, tensors))
    run_nodes(graph, range(len(nodes)), env, CPU)
    return [env[n] for n in outputs]


def check_chain(pool, nodes, inputs, outputs, tensors) -> None:
    """The nodes as one ninetoothed chain kernel: each output within a rounding of the chain
    computed in fp32 (its contract) and close to the op-by-op references."""
    chain = chain_from_nodes(nodes, inputs, outputs)
    got = run(pool, call_kernel, "elementwise_chain", "elementwise_chain", chain, *tensors)
    stepwise = unfused(nodes, inputs, outputs, tensors)
    in_fp32 = unfused(nodes, inputs, outputs, [t.float() for t in tensors])
    for g, s, f in zip(got, stepwise, in_fp32):
        expected = f.to(s.dtype)
        assert g.dtype == s.dtype and g.shape == s.shape
        tol = _ulps(g.dtype) * (1 + f.double().abs().max().item())
        assert (g.double() - expected.double()).abs().max().item() <= tol, (chain, g.dtype)
        assert op_registry.close_enough(g, s, computed_in=tensors[0].dtype)


def fusing_algorithms(graph: SubGraph, dtype=torch.bfloat16) -> set:
    """Which GPU algorithms take the whole of `graph` (an all_reduce and its epilogue; inputs
    named as symm_cases names them) as one fused span: the generic path ("nccl+nt_epilogue":
    NCCL, then one chain kernel) and the symmetric-memory kernels, judged on metadata alone."""
    from infini_dist.scheduler.backends.nccl_epilogue import NcclEpilogueAlgorithm
    from infini_dist.scheduler.backends.symm import plan_span
    span, meta = full_span(graph), meta_of(graph, (4, 64), dtype)
    ctx = RunContext(None, 2, 0, torch.device("cuda"))
    found = {"nccl+nt_epilogue"} if NcclEpilogueAlgorithm().supports(span, meta, ctx) else set()
    return found | ({"symm"} if plan_span(span, meta, ctx) is not None else set())


def full_depth_symm_choices(graph: SubGraph, dtype=torch.bfloat16) -> set:
    """The symmetric-memory algorithms among the engine's choices for `graph` (an all_reduce and
    its epilogue, named as symm_cases names inputs) on 2 GPUs that fuse the whole epilogue."""
    from infini_dist.scheduler.choices import generate_choices
    from infini_dist.scheduler.boundary import find_sites
    site = find_sites(graph)[0]
    choices = generate_choices(graph, site, meta_of(graph, (4, 64), dtype),
                               RunContext(None, 2, 0, torch.device("cuda")),
                               fusion_types=("epilogue",), max_depth=5, recursive=True)
    full = f"[p0,e{len(site.epilogue)}]"
    return {c.name[:-len(full)] for c in choices if c.name.endswith(full)} & set(symm_algorithms())


def check_symm(monkeypatch, pattern: str, algorithms=("one_shot", "two_shot")) -> None:
    """symm_cases' `pattern` through the named symmetric-memory algorithms on 2 interpreted
    ranks (fp32 at an odd row length, bf16): within tolerance of the unfused reference and
    bitwise equal across ranks."""
    assert set(algorithms) <= set(symm_algorithms())
    cases = [(name, pattern, shape, dtype) for name in algorithms
             for shape, dtype in (((3, 37), F32), ((2, 64), BF16))]
    run_interpreted(monkeypatch, 2, cases)


def compiled_site(fn, *args) -> SubGraph:
    """The one site the compile pass finds in `fn` (which calls test_compile.ar)."""
    from test_compile import export, fuse
    (site,) = fuse(export(fn, *args))
    return site


def ops_of(site: SubGraph) -> list:
    return [node.op_type for node in site.nodes]


def epilogue_chain(site: SubGraph):
    """The site's epilogue as the generic path's one chain kernel (UnsupportedChain if not)."""
    nodes = site.nodes[1:]
    produced = {name for node in nodes for name in node.outputs}
    inputs = dict.fromkeys(n for node in nodes for n in node.inputs if n not in produced)
    return chain_from_nodes(nodes, list(inputs), site.output_names)
