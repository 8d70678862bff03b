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


# The second group, balanced by the 2xH100 durations in docs/benchmarks.md. Every test that reads
# the shared run of tests/gpu_symm_worker.py (symm_gpu_report) is here, so it runs once.
SECOND_SPAN_GROUP = {"test_gpu_sequence_parallel.py", "test_symm_gemm_all_reduce.py",
                     "test_ops_autograd.py", "test_backends_symm.py",
                     "test_symm_lamport_one_shot.py", "test_symm_lamport_two_shot.py",
                     "test_symm_one_shot_all_reduce.py", "test_symm_two_shot_all_reduce.py",
                     "test_symm_two_shot_polled_gather.py"}


def _span_group(item) -> str:
    return "gpus_b" if item.path.name in SECOND_SPAN_GROUP else "gpus_a"


def pytest_collection_modifyitems(config, items):
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords:
            if gpus < 2:
                item.add_marker(pytest.mark.skip(reason="needs 2+ CUDA GPUs"))
            # With --dist loadgroup (.ci/gpu_suite), at most two tests that span the GPUs run at
            # once, each group's in order on one xdist worker; more would time-slice each
            # other's spinning kernels. Single-GPU tests spread over the other workers.
            item.add_marker(pytest.mark.xdist_group(_span_group(item)))
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


@pytest.fixture(scope="session")
def symm_gpu_report(tmp_path_factory):
    """tests/gpu_symm_worker.py run once for every symmetric-memory kernel's GPU test."""
    from symm_runs import run_gpu_report
    return run_gpu_report(tmp_path_factory.mktemp("symm_gpu"))
