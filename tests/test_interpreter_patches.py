"""tests/interpreter_patches.py: with the nested patches skipped, an interpreted kernel whose
helpers call our helpers and Triton's own (`tl.max`, `tl.sum`) computes what numpy does, and
each language module is patched once per launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)

_CHILD = r"""
import collections, sys
import numpy as np, torch, triton, triton.language as tl
sys.path.insert(0, sys.argv[1])
from interpreter_patches import skip_nested_language_patches
from triton.runtime import interpreter

@triton.jit
def scaled(x, scale):
    return x * scale

@triton.jit
def row_stats(x_ptr, out_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + 2 * row, tl.max(scaled(x, 2.0), 0))
    tl.store(out_ptr + 2 * row + 1, tl.sum(scaled(x, 0.5), 0))

patches = collections.Counter()
original = interpreter._patch_lang
def counted(fn):
    patches[fn.__name__] += 1
    return original(fn)
interpreter._patch_lang = counted
installed = skip_nested_language_patches() if sys.argv[2] == "skip" else False
x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
out = torch.empty(4, 2)
for _ in range(3):
    row_stats[(4,)](x, out, BLOCK=16)
want = np.stack([(2 * x.numpy()).max(1), (0.5 * x.numpy()).sum(1)], 1)
print(installed, np.allclose(out.numpy(), want, rtol=1e-5, atol=1e-5), sum(patches.values()))
"""


def _run(mode):
    done = subprocess.run([sys.executable, "-c", _CHILD, str(Path(__file__).parent), mode],
                          capture_output=True, text=True, timeout=100,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    installed, right, patches = done.stdout.split()
    return installed == "True", right == "True", int(patches)


def test_an_interpreted_kernel_computes_the_same_with_fewer_patches():
    installed, right, patches = _run("skip")
    assert installed and right
    # 3 launches of 4 programs: each launch patches its kernel's module and, once, the core
    # module for tl.max / tl.sum; our helper `scaled` never
    assert patches == 3 * 2, patches
    plain_installed, plain_right, plain_patches = _run("plain")
    assert not plain_installed and plain_right
    assert plain_patches == 3 * (1 + 4 * 4), plain_patches  # every helper call, every program


@pytest.mark.parametrize("dtype", [np.uint16, np.float16, np.int16, np.float32])
def test_whole_copies_load_and_store_as_the_interpreter_does(dtype):
    """The 2-byte path (numpy's whole-element copies; other sizes go to Triton's own) gives what
    Triton's interpreter module gives: masked places keep `other` in a load and stay untouched
    in a store, a scalar `other` is broadcast, pointers come in any order and shape."""
    from triton.runtime import interpreter

    from interpreter_patches import _WholeTwoByteCopies
    module = interpreter._interpreter
    module = getattr(module, "_module", module)  # Triton's own, under a session's install
    rng = np.random.default_rng(0)
    start = (rng.standard_normal(64) * 100).astype(dtype)
    order = rng.permutation(64)[:24].reshape(4, 6)
    mask = rng.random((4, 6)) < 0.7
    other, values = ((rng.standard_normal((4, 6)) * 100).astype(dtype) for _ in range(2))
    ends = []
    for copies in (_WholeTwoByteCopies(module), module):
        memory = start.copy()
        ptrs = (memory.ctypes.data + order * memory.itemsize).astype(np.uint64)
        got = copies.load(ptrs, mask, np.array(7, dtype=dtype), np.dtype(dtype))
        assert got.dtype == np.dtype(dtype) and got.shape == (4, 6)
        assert np.array_equal(got, np.where(mask, start[order], dtype(7)))
        assert np.array_equal(copies.load(ptrs, mask, other, np.dtype(dtype)),
                              np.where(mask, start[order], other))
        copies.store(ptrs, values, mask)
        ends.append(memory)
    assert np.array_equal(ends[0], ends[1])
    expected = start.copy()
    expected[order[mask]] = values[mask]
    assert np.array_equal(ends[0], expected)
