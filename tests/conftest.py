import os

import pytest


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own decision-cache dir and a clean in-process cache."""
    import infini_dist
    from infini_dist.scheduler.cache import DECISIONS
    cache = tmp_path / "infini_dist_cache"
    monkeypatch.setenv("INFINI_DIST_CACHE_DIR", str(cache))
    monkeypatch.setattr(infini_dist.config, "cache_dir", str(cache))
    DECISIONS.clear()
    yield cache
    DECISIONS.clear()


# Set before Inductor is imported anywhere: its config reads them once, at import. Every test,
# rank and launched job of the session inherits them (xdist workers start from this environment).
INDUCTOR_SESSION_ENV = {
    # Tests count what the compile pass did (sites, graphs recorded), so a graph must never be
    # served from a cache that skips the pass: another rank, test or earlier run may have
    # stored the same graph. test_compile_tp's FX-graph-cache test turns them back on for its
    # own per-rank cache dirs.
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
    # Scalar C++ kernels on CPU, not at::vec ones: Inductor's codegen and g++ both do less
    # (test_train_tp's Inductor route 87 -> 73-78 s, twice each). The graphs, and so what the
    # pass sees and writes, are the same; only the loops Inductor emits for them differ. GPU
    # kernels are Triton's, which this does not touch.
    "TORCHINDUCTOR_VEC_ISA_OK": "0",
}


def pytest_configure(config):
    # Interpreted kernels run here too (a test that sets TRITON_INTERPRET itself); rank and pool
    # processes install it on their own (multirank.py, interpreter_worker.py).
    from interpreter_patches import install
    install()
    if not hasattr(config, "workerinput"):  # the session's first process: xdist's controller
        _share_inductor_code_cache(config)


def _share_inductor_code_cache(config):
    """One Inductor cache dir for the whole session. With the FX graph and AOTAutograd caches
    off, what it shares is compiled code (C++ .so files by source hash, under a file lock per
    hash) and the precompiled ATen header: each test, rank and launched job compiled the same
    kernels again in a dir of its own, most of the CPU run's time. The pass still runs on
    every graph. Fresh per session, so a run's time does not depend on what ran before."""
    import shutil
    import tempfile
    path = tempfile.mkdtemp(prefix="infini_dist_inductor_")
    os.environ.update(INDUCTOR_SESSION_ENV, TORCHINDUCTOR_CACHE_DIR=path)
    if (os.cpu_count() or 1) <= 4:
        # Inductor compiles on the compiling thread, as launch_env's jobs and most ranks
        # already do: the pool it would start (subprocesses importing torch, per rank and
        # worker) only competes for the CPU CI machine's two cores
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))


def pytest_collection_modifyitems(config, items):
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        # Under pytest-xdist (.ci/gpu_suite) tests that span the GPUs run side by side: their
        # kernels time-slice the cards but make progress (two 2xH100 suite runs). Grouping them
        # with --dist loadgroup was tried: pytest-xdist 3.8 under pytest 9.2 ignores the groups.
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ CUDA GPUs"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def spread_single_gpu_tests(request):
    """Under pytest-xdist, a single-GPU test runs on GPU (worker index mod GPU count), so the
    workers' tests share the cards instead of all queueing on cuda:0."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if "gpu" in request.keywords and "multigpu" not in request.keywords and \
            worker.startswith("gw"):
        import torch
        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            torch.cuda.set_device(int(worker[2:]) % torch.cuda.device_count())
    yield


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A process where Triton interprets kernels on the CPU (tests/interpreter_worker.py)."""
    from interpreter_worker import interpreter_pool, interpreter_unusable
    if interpreter_unusable():
        pytest.skip(interpreter_unusable())
    with interpreter_pool(str(tmp_path_factory.mktemp("ninetoothed_home"))) as p:
        yield p


@pytest.fixture
def one_rank():
    """A one-rank gloo group, over which an all_reduce is the identity: graphs run in-process."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
