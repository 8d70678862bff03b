"""The session's Inductor settings (tests/conftest.py) hold where graphs are compiled: in the test
process and in a rank. Tests count what the compile pass did, so a cache that serves a graph
without running the pass must be off; had Inductor been imported before conftest set them, its
config would keep the defaults (it reads them once, at import) and this fails. Scalar CPU
kernels (no at::vec) make the session's compiles cheaper."""

from __future__ import annotations

import os

from multirank import run_ranks


def inductor_settings(rank=0, world=1):
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return {"fx_graph_cache": inductor_config.fx_graph_cache,
            "autograd_cache": functorch_config.enable_autograd_cache,
            "cache_dir": cache_dir(), "vec_isa_ok": inductor_config.cpp.vec_isa_ok}


def test_caches_that_skip_the_pass_are_off_and_compiled_code_is_shared():
    here = inductor_settings()
    assert here["fx_graph_cache"] is False and here["autograd_cache"] is False
    assert here["vec_isa_ok"] is False  # scalar CPU kernels: cheaper compiles (conftest.py)
    assert here["cache_dir"] == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert run_ranks(inductor_settings, 2) == [here, here]
