"""kernels/symm_call.py: the plain callables refuse bad input with a clear error before any
launch or buffer allocation (their numerics: tests/test_symm_<kernel>.py), and on a GPU every
spec'd step and norm compiles and runs in each of them."""

import os

import pytest
import torch

from infini_dist.kernels.one_shot_all_reduce import one_shot_all_reduce
from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes


def _buffer(world_size=2, data_bytes=1 << 12):
    return from_peer_tensors([torch.zeros(header_bytes(world_size) + data_bytes,
                                          dtype=torch.uint8) for _ in range(world_size)], 0)


@pytest.mark.parametrize("x, options, message", [
    (torch.arange(6.0).view(2, 3).int(), {}, "float16, bfloat16 or float32"),
    (torch.empty(0, 4), {}, "non-empty"),
    (torch.randn(2, 4), {"prologue": (("cube",),)}, "unknown chain step 'cube'"),
    (torch.randn(2, 4), {"epilogue": (("relu",),) * 4}, "at most 3 chain steps"),
    (torch.randn(2, 4), {"epilogue": (("scale",),)}, "takes 1 operand"),
    (torch.randn(2, 4), {"epilogue": (("relu", 2.0),)}, "takes 0 operand"),
    (torch.randn(2, 4), {"epilogue": (("mul", torch.randn(4)),)}, "shape (2, 4)"),
    (torch.randn(2, 4), {"epilogue": (("bias_add", torch.randn(2, 4)),)}, "shape (4,)"),
    (torch.randn(2, 4), {"epilogue": (("add", torch.randn(2, 4).half()),)}, "dtype"),
    (torch.randn(2, 4), {"residual": torch.randn(2, 4)}, "a residual or a bias needs a weight"),
    (torch.randn(2, 4), {"weight": torch.randn(4), "norm": "cube"}, "unknown norm 'cube'"),
    (torch.randn(2, 4), {"weight": torch.randn(4), "norm": "add_rms_norm"}, "unknown norm"),
    (torch.randn(2, 4), {"weight": torch.randn(4), "norm": "layer_norm"}, "needs bias"),
    (torch.randn(2, 4), {"weight": torch.randn(4), "bias": torch.randn(4)}, "takes no bias"),
    (torch.randn(2, 4), {"weight": torch.randn(3)}, "shape (4,)"),
    (torch.randn(2, 4), {"weight": torch.randn(4), "residual": torch.randn(4)}, "residual"),
    (torch.randn(64, 64), {}, "this call needs"),
    (torch.randn(2, 4), {"quant": ("quant_fp8",)}, "takes its scale, got 0"),
    (torch.randn(2, 4), {"quant": ("quant_fp8_tensor_scale",)}, "takes its scale tensor"),
])
def test_bad_input_raises_before_launch(x, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        one_shot_all_reduce(x, buffer=_buffer(), **options)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["one_shot", "two_shot", "two_shot_polled_gather",
                                    "lamport_one_shot", "lamport_two_shot",
                                    "lamport_one_shot_streamed"])
def test_every_step_and_norm_on_gpu(kernel):
    """Each spec'd chain step and norm compiled by the GPU compiler in `kernel`: one GPU
    suffices (tests/gpu_symm_every_step.py; the engine offers the kernels from two GPUs up). One
    kernel per test, so that pytest-xdist runs their compiles side by side."""
    import sys
    worker = os.path.join(os.path.dirname(__file__), "gpu_symm_every_step.py")
    from multirank import SAFE_GPU_ENV, run_process
    env = dict(os.environ, **SAFE_GPU_ENV)
    done = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={min(torch.cuda.device_count(), 2)}", worker, kernel],
                       env=env, timeout=280)
    assert done.returncode == 0 and "ALL OK" in done.stdout, \
        done.stdout[-4000:] + done.stderr[-4000:]
