"""Graphs, inputs and unfused references shared by the symmetric-memory kernel tests (CPU
interpreter ranks in symm_runs.py, real GPUs in gpu_symm_worker.py).

Each case is an all_reduce site with its prologue and epilogue, fused at full depth. Inputs are
random per rank and per call (never zeros); side tensors (residual, norm weight, swiglu up) are
the same on every rank, as in tensor parallelism, so every rank must get the same bits.
"""

from __future__ import annotations

import hashlib
import os

import torch

from infini_dist.kernels.epilogue import SPECS
from infini_dist.kernels.epilogue.rms_rstd import SPEC as RSTD_SPEC
from infini_dist.scheduler.choices import FusedSpan, RunContext, TensorMeta, run_nodes
from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.boundary import find_sites

CPU = RunContext(None, 1, 0, torch.device("cpu"))
RSTD = RSTD_SPEC.name
TRAIN = f"add_rms_norm+{RSTD}+reduced"
RSTD_TOLERANCE = 1e-5  # relative, for rstd_error: fp32 sums of a row in another order


def _graph(nodes, inputs, outputs):
    return SubGraph(tuple(nodes), tuple(inputs), tuple(outputs))


def _rstd(value: str) -> OpNode:
    """The norm's saved rsqrt, as the compile pass exposes it in a training forward."""
    return OpNode(RSTD, (value,), ("t",), {"eps": 1e-5})


def _spec_patterns() -> dict:
    """A pattern per norm, per vector step and per output quantizer of the op specs
    (kernels/epilogue), so every symmetric-memory kernel covers an op as soon as its spec exists:
    "add_then_<norm>" (the residual add, then the norm: weight "w", bias "b"), for a norm with an
    rsqrt also "add_then_<norm>+rstd" (its rms_rstd "t" too), "<step>" (y op b, b a 1-D
    vector), "add_rms_norm_<quantizer>" (the FP8 output beside the residual) and, for a
    quantizer needing no row, "silu_<quantizer>"."""
    ar = OpNode("all_reduce", ("x",), ("y",))
    patterns = {}
    for spec in SPECS.values():
        roles = spec.symm_norm.roles if spec.symm_norm else ("residual",)
        if "residual" not in roles:
            operands = ("s",) + tuple({"weight": "w", "bias": "b"}[r] for r in roles[1:])
            nodes = [ar, OpNode("add", ("res", "y"), ("s",)),
                     OpNode(spec.name, operands, ("n",), {"eps": 1e-5})]
            patterns[f"add_then_{spec.name}"] = _graph(nodes, ["x", "res", *operands[1:]],
                                                       ["n", "s"])
            if spec.symm_norm.rstd:
                patterns[f"add_then_{spec.name}+rstd"] = _graph(
                    nodes + [_rstd("s")], ["x", "res", *operands[1:]], ["n", "s", "t"])
        if spec.symm_quant is not None:
            patterns.update(_quant_patterns(ar, spec))
        for step in spec.symm_steps:
            if step.side == "vector":
                patterns[step.name] = _graph([ar, OpNode(spec.name, ("y", "b"), ("o",))],
                                             ["x", "b"], ["o"])
    return patterns


def _quant_patterns(ar, spec) -> dict:
    # scale 0.02: normed values of a few units land across e4m3's range, some beyond 448; a
    # scale tensor ("qscale", make_inputs) is near it and differs per call
    attrs = {"scale": 0.02} if spec.symm_quant.scalar == "scale" else {}  # a floor: its default
    scale = ["qscale"] if spec.symm_quant.scale_operand else []
    quantized = ("q", "qs")[:spec.num_outputs]
    patterns = {f"add_rms_norm_{spec.name}": _graph(
        [ar, OpNode("add_rms_norm", ("y", "res", "w"), ("n", "r"), {"eps": 1e-5}),
         OpNode(spec.name, ("n", *scale), quantized, attrs)], ["x", "res", "w", *scale],
        [*quantized, "r"])}
    if not spec.symm_quant.row_scale:
        patterns[f"silu_{spec.name}"] = _graph(
            [ar, OpNode("silu", ("y",), ("a",)),
             OpNode(spec.name, ("a", *scale), quantized, attrs)], ["x", *scale], list(quantized))
    return patterns


SPEC_PATTERNS = _spec_patterns()


def build(pattern) -> SubGraph:
    ar = OpNode("all_reduce", ("x",), ("y",))
    if pattern in SPEC_PATTERNS:
        return SPEC_PATTERNS[pattern]
    if pattern == "plain":
        return _graph([ar], ["x"], ["y"])
    if pattern == "add_rms_norm":
        return _graph([ar, OpNode("add_rms_norm", ("y", "res", "w"), ("n", "r"), {"eps": 1e-5})],
                      ["x", "res", "w"], ["n", "r"])
    if pattern == TRAIN:  # a training forward's site as the compile pass gives it (after
        # attention it also keeps the all_reduce's value)
        return _graph([ar, OpNode("add_rms_norm", ("y", "res", "w"), ("n", "r"), {"eps": 1e-5}),
                       _rstd("r")], ["x", "res", "w"], ["y", "n", "r", "t"])
    if pattern == "rms_norm+rstd":  # no residual: the rsqrt of the reduced value itself
        return _graph([ar, OpNode("rms_norm", ("y", "w"), ("n",), {"eps": 1e-5}), _rstd("y")],
                      ["x", "w"], ["n", "t"])
    if pattern == "relu_scale":
        return _graph([ar, OpNode("relu", ("y",), ("a",)),
                       OpNode("scale", ("a",), ("b",), {"scale": 0.37})], ["x"], ["b"])
    if pattern == "swiglu":
        return _graph([ar, OpNode("swiglu", ("y", "up"), ("o",))], ["x", "up"], ["o"])
    if pattern == "swiglu_up":
        return _graph([ar, OpNode("swiglu", ("gate", "y"), ("o",))], ["x", "gate"], ["o"])
    if pattern == "prologue_gelu":
        return _graph([OpNode("silu", ("x",), ("a",)), OpNode("scale", ("a",), ("b",),
                                                               {"scale": 2.0}),
                       OpNode("all_reduce", ("b",), ("y",)),
                       OpNode("gelu", ("y",), ("g",), {"approximate": "tanh"}),
                       OpNode("mul", ("g", "up"), ("o",)),
                       OpNode("sigmoid", ("o",), ("q",))], ["x", "up"], ["q"])
    if pattern == "prologue_norm":
        return _graph([OpNode("relu", ("x",), ("a",)), OpNode("all_reduce", ("a",), ("y",)),
                       OpNode("gelu", ("y",), ("g",)),
                       OpNode("add_rms_norm", ("res", "g", "w"), ("n", "r"))],
                      ["x", "res", "w"], ["n", "r"])
    raise ValueError(pattern)


PATTERNS = ("plain", "add_rms_norm", TRAIN, "rms_norm+rstd", "relu_scale", "swiglu",
            "swiglu_up", "prologue_gelu", "prologue_norm") + tuple(SPEC_PATTERNS)


def full_span(graph: SubGraph) -> FusedSpan:
    site = find_sites(graph)[0]
    return FusedSpan(graph, site.prologue, site.anchors, site.epilogue, site.beside)


def make_inputs(graph, shape, dtype, rank, call, device="cpu") -> dict:
    """x differs per rank and call; the side tensors differ per call only."""
    values = {}
    for name in graph.input_names:
        seed = 1000 * call + (rank + 1 if name == "x" else 100 + len(values))
        g = torch.Generator().manual_seed(seed)
        size = (shape[-1],) if name in ("w", "b") else () if name == "qscale" else shape
        t = torch.randn(size, generator=g)
        if name == "w":
            t = 0.5 + t.abs()
        if name == "qscale":  # a per-tensor FP8 scale
            t = 0.02 * (1 + t.abs())
        values[name] = t.to(dtype).to(device)
    return values


def meta_of(graph, shape, dtype, device_type="cuda") -> dict:
    """Every value's TensorMeta from one unfused pass on CPU, placed on `device_type`."""
    return meta_from(graph, make_inputs(graph, shape, dtype, 0, 0), device_type)


def meta_from(graph, inputs: dict, device_type="cuda") -> dict:
    """Every value's TensorMeta from one unfused pass over `inputs` (CPU), placed on
    `device_type` (the all_reduce's value: one rank's partial, same shape and dtype)."""
    env = dict(inputs)
    site = find_sites(graph)[0]
    run_nodes(graph, site.beside + site.prologue, env, CPU)
    anchor = graph.nodes[site.anchors[0]]
    env[anchor.outputs[0]] = env[anchor.inputs[0]].clone()
    run_nodes(graph, site.epilogue, env, CPU)
    return {n: TensorMeta(tuple(v.shape), v.dtype, torch.device(device_type), True)
            for n, v in env.items()}


def reference(graph, inputs_per_rank: list, rank: int) -> dict:
    """The unfused graph on rank `rank`'s inputs, the all_reduce summing every rank's value in
    fp32 and rounding once (the result every algorithm must reach)."""
    site = find_sites(graph)[0]
    envs = [dict(values) for values in inputs_per_rank]
    for env in envs:
        run_nodes(graph, site.beside + site.prologue, env, CPU)
    anchor = graph.nodes[site.anchors[0]]
    source = anchor.inputs[0]
    total = sum(env[source].double() for env in envs).to(envs[rank][source].dtype)
    env = envs[rank]
    env[anchor.outputs[0]] = total
    run_nodes(graph, site.epilogue, env, CPU)
    return {n: env[n] for n in graph.output_names}


def rstd_error(graph, got: dict, values: dict) -> float:
    """Largest relative error of the rms_rstd outputs against the fp64 rsqrt(mean(v^2) + eps) of
    the fp32 row v the norm read, where the outputs show v exactly: written in fp32, or (the
    training site) add_rms_norm's value written beside it, v being that plus the residual in
    fp32 as the kernels add it. A value rms_rstd's own reference would take from the rounded
    sum instead; this is tighter than `reference` for bf16. 0.0 where no v is shown."""
    producers = {out: node for node in graph.nodes for out in node.outputs}
    worst = 0.0
    for node in (n for n in graph.nodes if n.op_type == RSTD):
        (name,) = node.inputs
        norm = producers.get(name)
        if name in got and got[name].dtype == torch.float32:
            v = got[name].cpu()
        elif norm is not None and norm.op_type == "add_rms_norm" and norm.inputs[0] in got:
            v = got[norm.inputs[0]].cpu().float() + values[norm.inputs[1]].cpu().float()
        else:
            continue
        want = torch.rsqrt(v.double().pow(2).mean(-1, keepdim=True) + node.attr("eps"))
        have = got[node.outputs[0]].cpu()
        assert have.dtype == torch.float32 and have.shape == want.shape, (have.dtype, have.shape)
        worst = max(worst, float(((have.double() - want).abs() / want).max()))
    return worst


def digest(values: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(values):
        h.update(values[name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def max_error(got: dict, expected: dict) -> float:
    """Largest |got - expected| / (1 + |expected|) over all outputs (FP8 ones: `fp8_error`)."""
    worst = 0.0
    for name, e in expected.items():
        assert got[name].dtype == e.dtype, (name, got[name].dtype, e.dtype)
        g = got[name].double().cpu()
        e = e.double().cpu()
        assert g.shape == e.shape, (name, g.shape, e.shape)
        if expected[name].dtype == torch.float8_e4m3fn:
            worst = max(worst, fp8_error(g, e))
        else:
            worst = max(worst, float(((g - e).abs() / (1 + e.abs())).max()))
    return worst


def worst_places(got: dict, expected: dict) -> str:
    """Each output's error (max_error's measure) and, for the worst, the element where
    |got - expected| is largest: what a failure message needs when the failure is rare."""
    errors = {name: max_error({name: got[name]}, {name: e}) for name, e in expected.items()}
    name = max(errors, key=errors.get)
    g, e = got[name].double().cpu(), expected[name].double().cpu()
    place = tuple(int(i) for i in torch.unravel_index((g - e).abs().argmax(), e.shape))
    return (f"errors {({n: round(v, 6) for n, v in errors.items()})}, worst {name}{list(place)}: "
            f"got {g[place].item()!r}, expected {e[place].item()!r}")


def fp8_error(got, expected) -> float:
    """The worst |got - expected| beyond one e4m3 step, over 1 + max |expected|. A quantized value
    is in units of its scale, so the inputs' own rounding (an all_reduce result rounded to bf16,
    then a near-cancelling residual add) shows against the tensor's range, not the element's;
    one step is a rounding flip of nearly equal inputs. Under TRITON_INTERPRET, Triton 3.9's
    conversion to fp8 drops a carry into the next power of two (124 -> 64, not 128; the GPU's
    conversion does not), so there a power of two may stand for twice itself."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        power = torch.exp2(torch.round(torch.log2(got.abs()))) == got.abs()
        carried = torch.where(power, got * 2, got)
        got = torch.where((carried - expected).abs() < (got - expected).abs(), carried, got)
    magnitude = torch.maximum(got.abs(), expected.abs()).clamp_min(2.0 ** -6)  # subnormal: 2^-9
    step = torch.exp2(torch.floor(torch.log2(magnitude)) - 3)
    excess = ((got - expected).abs() - step).clamp_min(0)
    return float(excess.max() / (1 + expected.abs().max())) if excess.numel() else 0.0


def callable_quant(name: str, scale: float, device="cpu") -> tuple:
    """A plain callable's `quant` for output quantizer `name` (symm_chain.QUANT_CODES): a static
    `scale` as a float or as the one-element tensor a checkpoint holds, per-token quantizers with
    their default floor."""
    spec = SPECS[name].symm_quant
    if spec.scale_operand:
        return name, torch.tensor([scale], device=device)
    return (name,) if spec.row_scale else (name, scale)
