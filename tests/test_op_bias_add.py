"""bias_add: `add` with a 1-D bias over the last dim (a row-parallel linear's bias, added after
its all_reduce). The IR op is `add` (kernels/epilogue/add.py); the symmetric-memory chain runs
it as its "bias_add" step, loading the bias per column."""

import pytest
import torch

from epilogue_checks import (DTYPES, check_chain, check_reference, check_symm, compiled_site,
                             epilogue_chain, fusing_algorithms, ops_of, randn)
from infini_dist.kernels import symm_chain
from infini_dist.scheduler.ir import OpNode
from symm_cases import build
from test_compile import ar


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_against_fp64(dtype):
    x, b = randn((3, 5, 48), 1, dtype), randn((48,), 2, dtype)
    check_reference("add", [x, b], x.double() + b.double(), {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ninetoothed_chain(pool, dtype):
    nodes = [OpNode("add", ("ar", "b"), ("y",)), OpNode("relu", ("y",), ("z",))]
    tensors = [randn((4, 37), 3, dtype), randn((37,), 4, dtype)]
    check_chain(pool, nodes, ["ar", "b"], ["z"], tensors)


def test_every_gpu_algorithm_fuses_it():
    assert fusing_algorithms(build("bias_add")) == {"nccl+nt_epilogue", "symm"}


def test_symmetric_memory_kernels(monkeypatch):
    check_symm(monkeypatch, "bias_add")


def test_encoding_loads_the_bias_per_column():
    vector = {"b": "vector", "r": "row"}.get
    op = symm_chain.encode_node(OpNode("add", ("b", "y"), ("o",)), "y", vector, 48)
    assert op == symm_chain.ChainOp(symm_chain.CODES["bias_add"], 48.0, "b")
    assert symm_chain.encode_node(OpNode("add", ("y", "b"), ("o",)), "y", vector) is None
    assert symm_chain.encode_node(OpNode("mul", ("y", "b"), ("o",)), "y", vector, 48) is None
    assert symm_chain.encode_node(OpNode("add", ("y", "r"), ("o",)), "y", vector, 48).code == \
        symm_chain.CODES["add"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pass_matches_a_bias_add(dtype):
    def f(x, bias):
        return ar(x) + bias
    site = compiled_site(f, randn((2, 3, 16), 1, dtype), randn((16,), 2, dtype))
    assert ops_of(site) == ["all_reduce", "add"]
    assert epilogue_chain(site).inputs == ("row", "row")  # the bias broadcasts as a row
