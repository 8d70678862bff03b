"""tests/interpreter_patches.py: with the nested patches skipped, an interpreted kernel whose
helpers call our helpers and Triton's own (`tl.max`, `tl.sum`) computes what numpy does, and
each language module is patched once per launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
