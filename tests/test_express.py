"""The eager ops' C++ path (kernels/express.cpp, kernels/express.py) on the CPU: the table is
built for real, and a stand-in for cuLaunchKernelEx (a ctypes callback) plays the kernel: it
reads the parameters it is handed and writes 2 * x + 1 into the output's address. So these
tests see what a GPU launch would be handed (every parameter's bytes, the grid, the threads,
the shared memory), that the outputs returned are the tensors whose addresses were launched,
and which calls are matched: only the recorded op, group, scalar and exact layouts, never a
call autograd must see. The GPU tests (test_gpu_express.py) launch real kernels.
"""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace

import pytest
import torch

from infini_dist.kernels import express

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p))
SEEN = []


class _Attribute(ctypes.Structure):  # cuda.h's CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # cuda.h's CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attributes", ctypes.POINTER(_Attribute)), ("count", ctypes.c_uint)]


@LAUNCH
def _stand_in(config, function, params, extra):
    c = _Config.from_address(config)
    cells = [ctypes.c_uint64.from_address(params[i]).value for i in range(5)]
    SEEN.append(dict(function=function, grid=tuple(c.grid), block=tuple(c.block),
                     shared=c.shared, cells=cells,
                     attributes=[(c.attributes[i].id, c.attributes[i].value)
                                 for i in range(c.count)]))
    x_address, out_address, numel = cells[0], cells[2], cells[3] & 0xFFFFFFFF
    x = (ctypes.c_float * numel).from_address(x_address)
    out = (ctypes.c_float * numel).from_address(out_address)
    for i in range(numel):
        out[i] = 2 * x[i] + 1
    return 0


@pytest.fixture(scope="module")
def table():
    built = express.start(wait=True)
    if built is None:
        pytest.skip(f"the C++ table cannot be built here: {express._state['error']}")
    built.set_launcher(ctypes.cast(_stand_in, ctypes.c_void_p).value)
    yield built
    built.clear()


def _record(table, group, x, weight, scalar=0.5, aligned=(True, False), pdl=False):
    # parameters: x, weight (a fixed address), out, numel (i32), eps (fp32 bits)
    cells = [0, weight.data_ptr(), 0, x.numel(), struct.unpack("<I", struct.pack("<f", 1e-5))[0]]
    out = torch.empty_like(x)
    return express.add(3, group, scalar, -1, [x, weight], [out], [0],
                       dict(function=77, grid=[5, 1, 1], threads=128, shared=1024,
                            cells=cells, slots=[(0, 0), (2, 2)], pdl=pdl), list(aligned))


def _fresh(table):
    """The table emptied, then one record: (its group, x, weight)."""
    table.clear()
    group = object()
    x, weight = torch.randn(4, 8), torch.randn(8)
    _record(table, group, x, weight)
    return group, x, weight


def test_a_recorded_call_launches_from_cpp_with_the_recorded_parameters(table):
    table.clear()
    group = object()
    x, weight = torch.randn(4, 8), torch.randn(8)
    assert _record(table, group, x, weight)
    SEEN.clear()
    hits = table.hits()
    y = torch.randn(4, 8)
    (out,) = table.call(3, group, 0.5, [y, weight])
    assert table.hits() == hits + 1 and len(SEEN) == 1
    launch = SEEN[0]
    assert launch["function"] == 77 and launch["grid"] == (5, 1, 1)
    assert launch["block"] == (128, 1, 1) and launch["shared"] == 1024
    # per-call tensors by their addresses this call, the rest as recorded
    assert launch["cells"][:3] == [y.data_ptr(), weight.data_ptr(), out.data_ptr()]
    assert launch["cells"][3] == 32
    assert struct.unpack("<f", struct.pack("<I", launch["cells"][4] & 0xFFFFFFFF))[0] == \
        pytest.approx(1e-5)
    torch.testing.assert_close(out, 2 * y + 1, rtol=0, atol=0)
    assert out.shape == y.shape and out.dtype == y.dtype and out.is_contiguous()
    (again,) = table.call(3, group, 0.5, [y, weight])
    assert again.data_ptr() != out.data_ptr()  # fresh outputs every call


def test_a_pdl_record_launches_with_programmatic_stream_serialization(table):
    # A kernel compiled with launch_pdl: one launch attribute, programmatic stream serialization
    # (6) allowed (1); others none; the same grid, block, memory and parameters either way.
    for pdl in (True, False):
        table.clear()
        group, weight = object(), torch.randn(8)
        assert _record(table, group, torch.randn(4, 8), weight, pdl=pdl)
        SEEN.clear()
        y = torch.randn(4, 8)
        (out,) = table.call(3, group, 0.5, [y, weight])
        (launch,) = SEEN
        assert launch["attributes"] == ([(6, 1)] if pdl else [])
        assert (launch["function"], launch["grid"], launch["block"], launch["shared"]) == (
            77, (5, 1, 1), (128, 1, 1), 1024)
        assert launch["cells"][:3] == [y.data_ptr(), weight.data_ptr(), out.data_ptr()]
        torch.testing.assert_close(out, 2 * y + 1, rtol=0, atol=0)


def test_only_the_recorded_op_group_scalar_and_layouts_match(table):
    group, x, weight = _fresh(table)
    other = torch.randn(4, 8)
    assert table.call(3, group, 0.5, [other, weight]) is not None
    assert table.call(4, group, 0.5, [other, weight]) is None          # another op
    assert table.call(3, object(), 0.5, [other, weight]) is None       # another group
    assert table.call(3, None, 0.5, [other, weight]) is None
    assert table.call(3, group, 0.25, [other, weight]) is None         # another scalar
    assert table.call(3, group, 0.5, [torch.randn(5, 8), weight]) is None   # shape
    assert table.call(3, group, 0.5, [other.double(), weight]) is None      # dtype
    assert table.call(3, group, 0.5, [torch.randn(8, 4).t(), weight]) is None  # strides
    assert table.call(3, group, 0.5, [other]) is None                  # arity
    assert table.call(3, group, 0.5, [other, None]) is None            # not a tensor
    assert table.call(3, group, 0.5, [other, 1.0]) is None
    unaligned = torch.randn(33)[1:].view(4, 8)  # 4 bytes past an aligned start
    assert unaligned.data_ptr() % 16
    assert table.call(3, group, 0.5, [unaligned, weight]) is None
    # weight is not launched by address through a slot (aligned=False): any address matches
    assert table.call(3, group, 0.5, [other, torch.randn(9)[1:]]) is not None
    table.clear()
    assert table.call(3, group, 0.5, [other, weight]) is None


def test_calls_autograd_must_see_take_the_python_path(table):
    group, x, weight = _fresh(table)
    wants = torch.randn(4, 8, requires_grad=True)
    assert table.call(3, group, 0.5, [wants, weight]) is None
    with torch.no_grad():
        assert table.call(3, group, 0.5, [wants, weight]) is not None


def test_a_config_change_or_a_replaced_op_forgets_every_record(table):
    import infini_dist
    from infini_dist.scheduler import op_registry
    group = object()
    x, weight = torch.randn(4, 8), torch.randn(8)
    table.clear()
    _record(table, group, x, weight)
    infini_dist.config.benchmark_reps = infini_dist.config.benchmark_reps
    assert table.size() == 0
    _record(table, group, x, weight)
    with infini_dist.config.patch(debug_mode=False):
        pass
    assert table.size() == 0
    _record(table, group, x, weight)
    op_registry.register_op("express_test_double", lambda t: 2 * t, kind="elementwise",
                            replace=True)
    assert table.size() == 0


def test_pack_flattens_tuples_drops_constexprs_and_marks_per_call_tensors():
    import triton
    import triton.language as tl

    from infini_dist.kernels.nt_runtime import FastLaunch

    @triton.jit
    def kernel(x_ptr, chain, table_ptr, n, rank, eps, BLOCK: tl.constexpr):
        pass

    x, side, out, table = (torch.empty(4) for _ in range(4))
    launch = FastLaunch(kernel, (3,), (x, (1.5, side, out), table, 1 << 40, -2, 0.25),
                        dict(BLOCK=64, num_warps=4), [x, out])
    signature = {"x_ptr": "*fp32", "chain": ("fp32", "*fp32", "*fp32"), "table_ptr": "*i64",
                 "n": "i64", "rank": "i32", "eps": "fp32", "BLOCK": "constexpr"}
    cells, slots, sizes = express.pack(SimpleNamespace(src=SimpleNamespace(signature=signature)),
                                       launch)
    as_fp32 = struct.unpack("<I", struct.pack("<f", 1.5))[0]
    assert cells == [0, as_fp32, side.data_ptr(), 0, table.data_ptr(), 1 << 40,
                     (-2) & ((1 << 64) - 1), struct.unpack("<I", struct.pack("<f", 0.25))[0]]
    assert slots == [(0, 0), (3, 1)]
    assert sizes == [8, 4, 8, 8, 8, 8, 4, 4]
    signature["eps"] = "fp16"  # a type the packing does not know: no record
    assert express.pack(SimpleNamespace(src=SimpleNamespace(signature=signature)), launch) \
        is None


def test_launch_record_only_where_the_driver_reports_the_packed_parameters(monkeypatch):
    import triton
    import triton.language as tl

    from infini_dist.kernels.nt_runtime import FastLaunch

    @triton.jit
    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        pass

    x = torch.empty(4)
    launch = FastLaunch(kernel, (2,), (x, 7), dict(BLOCK=64), [x])
    metadata = SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, num_ctas=1,
                               launch_cooperative_grid=False, launch_pdl=False, num_warps=4,
                               shared=96)
    launch.compiled = SimpleNamespace(src=SimpleNamespace(signature={
        "x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}), metadata=metadata, function=5)
    launch._launcher = object()  # on its short path
    driver = {"sizes": [8, 4, 8, 8]}  # Triton's two scratch pointers after the kernel's own
    monkeypatch.setitem(express._state, "module",
                        SimpleNamespace(param_sizes=lambda function: driver["sizes"],
                                        clear=lambda: None))
    record = express.launch_record(launch)
    assert record == dict(function=5, grid=[2, 1, 1], threads=128, shared=96,
                          cells=[0, 7, 0, 0], slots=[(0, 0)], pdl=False)
    metadata.launch_pdl = True  # launched with programmatic dependent launch
    assert express.launch_record(launch)["pdl"] is True
    metadata.launch_pdl = False
    for sizes in ([8, 8, 8, 8], [8, 4, 8, 8, 8], [8], []):  # not the ABI packed: no record
        driver["sizes"] = sizes
        assert express.launch_record(launch) is None, sizes
    driver["sizes"] = [8, 4]
    assert express.launch_record(launch) is not None
    metadata.global_scratch_size = 64  # the kernel needs scratch Triton's launcher allocates
    assert express.launch_record(launch) is None
    metadata.global_scratch_size = 0
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *args: None)
    assert express.launch_record(launch) is None



def test_many_records_each_match_only_their_own_layout(table):
    # A serving job's token counts: one record per count, found by lookup, each launching its
    # own parameters.
    table.clear()
    group = object()
    weight = torch.randn(8)
    for tokens in range(1, 301):
        assert _record(table, group, torch.randn(tokens, 8), weight, scalar=0.5)
    assert table.size() == 300
    for tokens in (1, 7, 150, 300):
        y = torch.randn(tokens, 8)
        SEEN.clear()
        (out,) = table.call(3, group, 0.5, [y, weight])
        assert SEEN[0]["cells"][3] & 0xFFFFFFFF == tokens * 8
        torch.testing.assert_close(out, 2 * y + 1, rtol=0, atol=0)
    assert table.call(3, group, 0.5, [torch.randn(301, 8), weight]) is None
    assert table.call(3, group, 0.25, [torch.randn(7, 8), weight]) is None


def test_only_plain_tensors_on_the_recorded_device_match(table):
    # The table reads tensors through their Python attributes: a subclass (a fake, functional
    # or DTensor wrapper is one) could answer them differently, so only Tensor and Parameter
    # are taken; a record for a CUDA device never takes CPU tensors.
    class Tagged(torch.Tensor):
        pass

    group, x, weight = _fresh(table)
    y = torch.randn(4, 8)
    assert table.call(3, group, 0.5, [y.as_subclass(Tagged), weight]) is None
    (out,) = table.call(3, group, 0.5, [y, torch.nn.Parameter(weight, requires_grad=False)])
    torch.testing.assert_close(out, 2 * y + 1, rtol=0, atol=0)
    assert type(out) is torch.Tensor
    cells = [0, weight.data_ptr(), 0, x.numel(), 0]
    assert express.add(3, group, 0.75, 0, [x, weight], [torch.empty_like(x)], [0],
                       dict(function=77, grid=[5, 1, 1], threads=128, shared=0, cells=cells,
                            slots=[(0, 0), (2, 2)]), [True, False])
    assert table.call(3, group, 0.75, [y, weight]) is None


def test_a_malformed_record_is_refused_with_a_clear_error_and_kept_out(table):
    table.clear()
    group = object()
    x, weight = torch.randn(4, 8), torch.randn(8)
    good = dict(function=77, grid=[5, 1, 1], threads=128, shared=0, cells=[0, 0, 0, 32, 0],
                slots=[(0, 0), (2, 2)])
    for bad, message in ((dict(slots=[(9, 0)]), "out of range"),
                         (dict(slots=[(0, 7)]), "out of range"),
                         (dict(grid=[5, 1]), "grid")):
        with pytest.raises(ValueError, match=message):
            express.add(3, group, 0.5, -1, [x, weight], [torch.empty_like(x)], [0],
                        {**good, **bad}, [True, False])
    with pytest.raises(ValueError, match="returned"):
        express.add(3, group, 0.5, -1, [x, weight], [torch.empty_like(x)], [1], good,
                    [True, False])
    assert table.size() == 0
    assert table.call(3, group, 0.5, [x, weight]) is None


def test_calls_it_cannot_read_take_the_python_path_and_leave_no_error(table):
    group, x, weight = _fresh(table)
    for args in ((3, group, "0.5", [x, weight]), (3, group, 0.5, 5), ("3", group, 0.5, [x]),
                 (3, group, 0.5, (x, weight), "extra"), (3, group, 0.5, [x.to_sparse(), weight])):
        assert table.call(*args) is None, args
    assert table.call(3, group, 0.5, (x, weight)) is not None  # a tuple serves as a list does


_EXIT_WITH_RECORDS = """
import ctypes, torch
from infini_dist.kernels import express
built = express.start(wait=True)
built.set_launcher(ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value)  # 0: done
group, x, weight = object(), torch.randn(4, 8), torch.randn(8)
assert express.add(3, group, 0.5, -1, [x, weight], [torch.empty_like(x)], [0],
                   dict(function=1, grid=[1, 1, 1], threads=32, shared=0,
                        cells=[0, weight.data_ptr(), 0, 32, 0], slots=[(0, 0), (2, 2)]),
                   [True, False])
assert built.call(3, group, 0.5, [x, weight]) is not None
print("recorded and launched", flush=True)
"""


def test_a_process_with_records_exits_cleanly(table):
    # The records hold Python references; C++ must not drop them after the interpreter is gone
    # (a static table's destructor at exit aborted the process: "PyThreadState_Get").
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _EXIT_WITH_RECORDS], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0 and "recorded and launched" in done.stdout, done.stderr[-2000:]
    assert "Fatal Python error" not in done.stderr
