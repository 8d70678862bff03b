"""quant_fp8_per_token (kernels/epilogue/quant_fp8_per_token.py): per row, scale = max|row| / 448
(at least min_scale, by default 1 / (448 * 512)), (row / scale).clamp(-448, 448) as
float8_e4m3fn, and the fp32 scales (rows x 1); quant_fp8_per_token_reciprocal multiplies by the
scale's reciprocal instead. Alone, and after all_reduce + add + RMSNorm in the symmetric-memory
kernels and in the ninetoothed chain (nccl+nt_epilogue: the scales are the chain's per-row
output); the spellings users write, matched by the pass."""

import pytest
import torch

from epilogue_checks import (DTYPES, check_symm, compiled_site, full_depth_symm_choices,
                             fusing_algorithms, ops_of, randn, unfused)
from fx_graphs import ar, llama_norm
from infini_dist.compile.fx_patterns import FORMS
from infini_dist.kernels.chain import UnsupportedChain, chain_from_nodes
from infini_dist.kernels.epilogue.quant_fp8_per_token import MIN_SCALE
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.backends.nccl_epilogue import plan
from infini_dist.scheduler.ir import OpNode, SubGraph
from interpreter_worker import run
from symm_cases import build, fp8_error, full_span, meta_of
from symm_runs import symm_algorithms

FP8 = torch.float8_e4m3fn
PATTERN = "add_rms_norm_quant_fp8_per_token"


RECIPROCAL = "quant_fp8_per_token_reciprocal"


def fp64(x, min_scale=MIN_SCALE):
    x = x.double()
    scales = (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(min_scale)
    return (x / scales).clamp(-448.0, 448.0), scales


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_against_fp64(dtype):
    x = randn((3, 5, 48), 1, dtype) * torch.linspace(0.01, 300, 15).view(3, 5, 1).to(dtype)
    x[1, 2] = 0  # an all-zero row: the floor keeps its scale finite, its values zero
    q, scales = op_registry.run_node("quant_fp8_per_token", [x], {})
    expected, expected_scales = fp64(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (3, 5, 1)
    assert torch.allclose(scales.double(), expected_scales, rtol=2.0 ** -23, atol=0)
    assert scales[1, 2].item() == pytest.approx(MIN_SCALE) and not q[1, 2].float().any()
    # each row's largest value maps to +-448; every value within half an fp8 step of exact
    assert (q.float().abs().amax(-1) == 448).sum() == 14
    assert ((q.double() - expected).abs() <= expected.abs() * 2.0 ** -4 + 2.0 ** -10).all()
    native_q, native_scales = op_registry.run_node("quant_fp8_per_token", [x], {}, native=True)
    assert torch.equal(native_scales, scales) and torch.equal(native_q.float(), q.float())
    # the reciprocal's product: the same scales, values at most one step apart, bit for bit
    # what its native (vLLM's forward_native) gives
    r_q, r_scales = op_registry.run_node(RECIPROCAL, [x], {})
    assert torch.equal(r_scales, scales) and op_registry.close_enough(r_q, q)
    r_native, _ = op_registry.run_node(RECIPROCAL, [x], {}, native=True)
    assert torch.equal(r_native.float(), r_q.float())
    # another floor: rows below it get it as their scale
    floored, floored_scales = op_registry.run_node("quant_fp8_per_token", [x],
                                                   {"min_scale": 0.01})
    expected, expected_scales = fp64(x, 0.01)
    assert torch.allclose(floored_scales.double(), expected_scales, rtol=2.0 ** -23, atol=0)
    assert bool((floored_scales == torch.tensor(0.01)).any())
    with pytest.raises(TypeError):
        op_registry.run_node("quant_fp8_per_token", [torch.arange(6)], {})


def test_both_paths_fuse_it_after_add_rms_norm():
    assert fusing_algorithms(build(PATTERN)) == {"nccl+nt_epilogue", "symm"}
    assert fusing_algorithms(build(PATTERN), torch.float32) == {"nccl+nt_epilogue", "symm"}
    p = plan(full_span(build(PATTERN)), meta_of(build(PATTERN), (2, 3, 64), torch.bfloat16))
    assert p.chain_outputs == ("r", "q", "qs") and p.chain.rowwise
    assert p.chain.output_shapes((2, 3, 64)) == [(2, 3, 64), (2, 3, 64), (2, 3, 1)]
    assert p.chain.output_dtypes([torch.bfloat16] * 2 + [torch.float32]) == [
        torch.bfloat16, FP8, torch.float32]
    assert p.in_place == 0  # the reduced buffer takes the residual sum


def test_the_plan_keeps_the_scales_out_of_the_reduced_buffer():
    # fp32 scales have the dtype of an fp32 reduction, not its shape
    graph = SubGraph((OpNode("all_reduce", ("x",), ("y",)),
                      OpNode("rms_norm", ("y", "w"), ("n",), {"eps": 1e-5}),
                      OpNode("quant_fp8_per_token", ("n",), ("q", "qs"))), ("x", "w"), ("q", "qs"))
    assert fusing_algorithms(graph, torch.float32) == {"nccl+nt_epilogue", "symm"}
    p = plan(full_span(graph), meta_of(graph, (4, 37), torch.float32))
    assert p.chain_outputs == ("q", "qs") and p.in_place is None
    meta = meta_of(graph, (4, 37), torch.float32)
    meta["qs"] = meta["qs"]._replace(shape=(4, 37))  # scales of another shape are refused
    with pytest.raises(UnsupportedChain, match="shape"):
        plan(full_span(graph), meta)


def test_the_engine_offers_every_symm_kernel_at_full_depth():
    assert full_depth_symm_choices(build(PATTERN)) == set(symm_algorithms())


def test_per_token_needs_the_whole_row():
    # The symmetric-memory kernels hold a whole row only in their norm slot; the chain kernel
    # runs whole rows per tile in any chain with a rowwise op, this one included.
    graph = SubGraph((OpNode("all_reduce", ("x",), ("y",)),
                      OpNode("quant_fp8_per_token", ("y",), ("q", "qs"))), ("x",), ("q", "qs"))
    assert fusing_algorithms(graph) == {"nccl+nt_epilogue"}
    assert full_depth_symm_choices(graph) == set()
    assert chain_from_nodes(graph.nodes[1:], ["y"], ["q", "qs"]).rowwise


def test_its_values_are_only_stored():
    quant = OpNode("quant_fp8_per_token", ("a",), ("q", "s"))
    with pytest.raises(UnsupportedChain, match="per-row value"):
        chain_from_nodes([quant, OpNode("scale", ("s",), ("t",), {"scale": 2.0})], ["a"], ["t"])
    with pytest.raises(UnsupportedChain, match="quantized"):
        chain_from_nodes([quant, OpNode("relu", ("q",), ("r",))], ["a"], ["r"])


# ---- the ninetoothed chain (nccl+nt_epilogue's kernel) ---------------------------------------

def N(op, *names, **attrs):
    """N("add", "a", "b", "c") is c = add(a, b); several outputs go in a tuple."""
    *inputs, outputs = names
    return OpNode(op, tuple(inputs), (outputs,) if isinstance(outputs, str) else tuple(outputs),
                  attrs)


CHAINS = {  # name: (nodes, inputs, outputs)
    "add_rms_norm": ([N("add_rms_norm", "ar", "res", "w", ("n", "h"), eps=1e-5),
                      N("quant_fp8_per_token", "n", ("q", "s"))], ["ar", "res", "w"],
                     ["q", "s", "h"]),
    "rms_norm": ([N("rms_norm", "ar", "w", "n", eps=1e-6),
                  N("quant_fp8_per_token", "n", ("q", "s"))], ["ar", "w"], ["s", "q"]),
    # past the row end sigmoid makes 0.5 of the zeros, above every value here: masked off
    "sigmoid": ([N("sigmoid", "ar", "a"), N("quant_fp8_per_token", "a", ("q", "s"))], ["ar"],
                ["q", "s"]),
}


def chain_inputs(name, shape, dtype, device="cpu"):
    values = {"ar": randn(shape, 1, dtype) * 3, "res": randn(shape, 2, dtype),
              "w": randn(shape[-1:], 3, offset=1.0)}
    if name == "sigmoid":
        values["ar"] = randn(shape, 1, dtype, offset=-4.0)
    _, inputs, _ = CHAINS[name]
    return [values[n].to(device) for n in inputs]


def chain_errors(name, tensors):
    """Run the chain (in the interpreter's process under `pool`, or on the GPU) and compare its
    outputs with the references on the CPU. The FP8 values: with the quantization of the same
    value computed in fp32 (the kernel's contract: fp32 between steps) and with the step-by-step
    references (which round the norm's output to the input dtype first), each within one e4m3
    step (`fp8_error`, which knows the interpreter's conversion, as the symmetric-memory tests
    compare); the scales: with the fp32 quantization's; every other output as the engine checks
    it. Returns ((FP8 errors), worst relative scale error, outputs not close)."""
    from infini_dist.kernels.elementwise_chain import elementwise_chain
    nodes, inputs, outputs = CHAINS[name]
    got = [t.cpu() for t in elementwise_chain(chain_from_nodes(nodes, inputs, outputs), *tensors)]
    cpu = [t.cpu() for t in tensors]
    in_fp32 = dict(zip(outputs, unfused(nodes, inputs, outputs, [t.float() for t in cpu])))
    stepwise = dict(zip(outputs, unfused(nodes, inputs, outputs, cpu)))
    out = dict(zip(outputs, got))
    assert out["q"].dtype == FP8 and out["q"].shape == cpu[0].shape
    assert out["s"].dtype == torch.float32 and out["s"].shape == cpu[0].shape[:-1] + (1,)
    fp8 = tuple(fp8_error(out["q"].double(), ref["q"].double()) for ref in (in_fp32, stepwise))
    scale_error = float(((out["s"].double() - in_fp32["s"].double()).abs()
                         / in_fp32["s"].double()).max())
    not_close = [n for n in outputs if n != "q" and not op_registry.close_enough(
        out[n], stepwise[n], computed_in=cpu[0].dtype)]
    return fp8, scale_error, not_close


def _check(name, shape, errors):
    fp8, scale, not_close = errors
    assert fp8 == (0, 0), (name, shape, fp8)  # every value within one e4m3 step of both
    assert scale <= 1e-5, (name, shape, scale)  # fp32 sums and rsqrt in another order
    assert not not_close, (name, shape, not_close)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_ninetoothed_chain_interpreted(pool, name, dtype):
    for shape in [(2, 3, 37), (4, 64), (3, 100)]:  # odd, a power of two, and between
        _check(name, shape, run(pool, chain_errors, name, chain_inputs(name, shape, dtype)))


def compile_chain(name, shape, dtype):
    """In the compile worker (launch_stub.compile_pool): the chain kernel as a launch would make
    it, through Triton's CUDA backend down to a cubin for sm_90; launches nothing. Returns
    whether its PTX converts to e4m3."""
    from infini_dist.kernels import nt_runtime
    from infini_dist.kernels.elementwise_chain import make
    from infini_dist.kernels.rows import num_warps, row_blocks
    nodes, inputs, outputs = CHAINS[name]
    chain = chain_from_nodes(nodes, inputs, outputs)
    block_m, block_n = row_blocks(shape[0], shape[1])
    handle = make(chain, block_m, block_n, num_warps(block_m, block_n))
    tensors = chain_inputs(name, shape, dtype)
    outs = [torch.empty(s, dtype=d) for s, d in zip(
        chain.output_shapes(shape), chain.output_dtypes([t.dtype for t in tensors]))]
    # the arguments ninetoothed's launch function passes the Triton kernel, recorded
    recorded = nt_runtime.fast_launch(handle, tensors + [shape[1]] + outs, tensors + outs)
    compiled = recorded.kernel.warmup(*recorded._fill(tensors + outs), grid=recorded.grid,
                                      **recorded.options)
    return "cvt.rn.satfinite.e4m3x2" in compiled.asm["ptx"]


def test_ninetoothed_chain_compiles_for_sm90(tmp_path):
    """The interpreter compiles nothing: the (block_m, 1) tiles of the scales and the row max
    through the GPU compiler, on the CPU."""
    pytest.importorskip("triton.backends.nvidia")
    from launch_stub import compile_pool
    with compile_pool(str(tmp_path / "home")) as pool:
        for name in sorted(CHAINS):
            for shape, dtype in (((3, 37), torch.bfloat16), ((128, 5120), torch.float32)):
                assert pool.submit(compile_chain, name, shape, dtype).result(timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_ninetoothed_chain_on_gpu(name, dtype):
    for shape in [(1, 4096), (128, 5120), (3, 4100), (2, 3, 37)]:
        _check(name, shape, chain_errors(name, chain_inputs(name, shape, dtype, "cuda")))


@pytest.mark.parametrize("pattern", [PATTERN, f"add_rms_norm_{RECIPROCAL}"])
def test_every_symm_kernel_interpreted(monkeypatch, pattern):
    """The FP8 output and its scales beside the bf16 residual, 2 ranks, every kernel."""
    check_symm(monkeypatch, pattern, tuple(symm_algorithms()))


@pytest.mark.parametrize("form", [f for f in FORMS if f.op_type.startswith("quant_fp8_per_token")],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pass_matches_it_after_the_norm(form, dtype):
    def f(x, residual, w):
        h = ar(x) + residual
        q, scales = form.fn(llama_norm(h, w, 1e-5))
        return q, scales, h
    site = compiled_site(f, randn((2, 16), 1, dtype), randn((2, 16), 2, dtype),
                         randn((16,), 3, dtype))
    assert ops_of(site) == ["all_reduce", "add_rms_norm", form.op_type]
    assert set(site.nodes[-1].outputs) <= set(site.output_names)  # the scales are read too


def test_a_floor_before_the_division_is_the_same_floor_after_it():
    """max.clamp(min=eps) / 448 is (max / 448).clamp(min=fl32(eps / 448)), bit for bit: the
    pass turns the one into the other's min_scale."""
    x = randn((64, 48), 5) * torch.logspace(-9, 1, 64).view(64, 1)  # rows above and below
    for eps in (1e-6, 1e-8, 3e-7):
        row_max = x.abs().amax(-1, keepdim=True)
        user = row_max.clamp(min=eps) / 448
        floor = float(torch.tensor(eps, dtype=torch.float32) / 448.0)
        _, scales = op_registry.run_node("quant_fp8_per_token", [x], {"min_scale": floor})
        assert bool((row_max < eps).any()) and bool((row_max > eps).any())
        assert torch.equal(scales, user)


def test_a_half_precision_scale_is_not_the_op():
    """Scales computed in bf16 (no upcast) round differently: the pass leaves them unfused."""
    def f(x, residual, w):
        h = ar(x) + residual
        n = llama_norm(h, w, 1e-5)
        scale = n.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / 448
        return (n / scale).clamp(-448, 448).to(FP8), scale, h
    dtype = torch.bfloat16
    site = compiled_site(f, randn((2, 16), 1, dtype), randn((2, 16), 2, dtype),
                         randn((16,), 3, dtype))
    assert ops_of(site) == ["all_reduce", "add_rms_norm"]


def _fold_rank(rank, world_size, storage_sets):
    """On each rank: the streamed Lamport kernel's FP8 output and scales with the row max taken
    from the norm's reduction and from a pass of its own, which must be the same bits."""
    from infini_dist.kernels.lamport_one_shot_streamed import (
        lamport_one_shot_streamed_all_reduce as kernel)
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    from infini_dist.kernels.symm_device import SymmTuning
    results = []
    for (rows, row, group), storages in zip(FOLD_SHAPES, storage_sets):
        buffer = from_peer_tensors(storages, rank)
        for norm, quant in [("rms_norm", "quant_fp8_per_token"), ("gemma_rms_norm", RECIPROCAL),
                            ("add_rms_norm", "quant_fp8_per_token")]:
            x = randn((rows, row), 10 + rank, torch.bfloat16) * 3
            x[0] = 0  # every rank's row 0 zero: the scale's floor
            weight = randn((row,), 1, torch.bfloat16)
            options = dict(weight=weight, quant=(quant,), buffer=buffer)
            if norm == "add_rms_norm":
                options["residual"] = randn((rows, row), 2, torch.bfloat16)
            else:
                options["norm"] = norm
            got = [kernel(x, tuning=SymmTuning(fold_row_max=fold, group_items=group), **options)
                   for fold in (True, False)]
            for folded, own_pass in zip(*got):
                assert torch.equal(folded.view(torch.uint8) if folded.dtype == FP8 else folded,
                                   own_pass.view(torch.uint8) if own_pass.dtype == FP8
                                   else own_pass), (norm, rows, row, group)
            results.append(got[0][1].sum().item())
    return results


FOLD_SHAPES = [(5, 64, 0), (12, 24, 2)]  # one row a program; two a step, the last group partial


def test_the_norms_row_max_gives_the_scales_bits():
    """The kernels take a per-token quantizer's row max from the RMSNorm's reduction, as
    max|weight * h| * rstd rounded: rounding is monotonic, so that is exactly the max of the
    rounded outputs. Checked bitwise against the quantizer's own pass, 2 interpreted ranks."""
    from infini_dist.kernels.symm_buffers import fill_empty, header_bytes
    from multirank import run_ranks
    storage_sets = []
    for _ in FOLD_SHAPES:
        storages = [torch.zeros(header_bytes(2) + (1 << 16), dtype=torch.uint8).share_memory_()
                    for _ in range(2)]
        for storage in storages:
            fill_empty(storage, 2, 16)  # bf16 places
        storage_sets.append(storages)
    per_rank = run_ranks(_fold_rank, 2, storage_sets, timeout=300,
                         env={"TRITON_INTERPRET": "1"})
    assert per_rank[0] == per_rank[1]
