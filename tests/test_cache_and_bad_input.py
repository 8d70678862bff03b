"""The decision cache across runs, and inputs that are wrong or unusual."""

import json
import os

import torch

from multirank import run_ranks
from test_engine_consensus import ar_block_graph, expected, inputs_for


def tune_once(rank, world_size):
    import infini_dist
    from infini_dist.scheduler.cache import DECISIONS
    from infini_dist.scheduler.engine import executor_for
    with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2):
        executor = executor_for(ar_block_graph(), infini_dist.config.snapshot())
        out = executor.run(inputs_for(rank))
        out = executor.run(inputs_for(rank))  # second call: committed choice, no tuning
    runner = executor.site_runners()[0]
    act, _ = expected(world_size)
    torch.testing.assert_close(out["act"].double(), act, rtol=1e-5, atol=1e-5)
    return {"hits": DECISIONS.hits, "misses": DECISIONS.misses,
            "tuned": getattr(runner, "last_tuning", None) is not None,
            "files": sorted(os.listdir(infini_dist.config.cache_dir))
            if os.path.isdir(infini_dist.config.cache_dir) else []}


def test_second_run_hits_the_disk_cache(tmp_path):
    first = run_ranks(tune_once, 2, cache_dir=str(tmp_path))
    assert [r["misses"] for r in first] == [1, 1] and all(r["tuned"] for r in first)
    assert len(first[0]["files"]) == 1
    second = run_ranks(tune_once, 2, cache_dir=str(tmp_path))
    assert [r["hits"] for r in second] == [1, 1] and [r["misses"] for r in second] == [0, 0]
    assert not any(r["tuned"] for r in second)


def tune_without_the_cpu_backend(rank, world_size):
    from infini_dist.scheduler.choices import unregister_algorithm
    unregister_algorithm("all_reduce", "cpu", "torch_fused")  # as if its package were missing
    return tune_once(rank, world_size)


def test_a_decision_made_while_a_backend_was_missing_is_not_reused_once_it_is_there(tmp_path):
    first = run_ranks(tune_without_the_cpu_backend, 2, cache_dir=str(tmp_path))
    assert [r["misses"] for r in first] == [1, 1]
    second = run_ranks(tune_once, 2, cache_dir=str(tmp_path))
    assert [r["misses"] for r in second] == [1, 1] and all(r["tuned"] for r in second)
    assert len(second[0]["files"]) == 2  # each choice list keeps its own decision


def test_only_rank_zero_needs_the_cache_file(tmp_path):
    run_ranks(tune_once, 2, cache_dir=str(tmp_path))
    # hit/miss is rank 0's answer, broadcast: rank 1 agrees even though it sees no file
    second = run_ranks(rank_one_blind, 2, str(tmp_path))
    assert [r["hits"] for r in second] == [1, 1]


def rank_one_blind(rank, world_size, shared_dir):
    import infini_dist
    if rank == 1:
        infini_dist.config.cache_dir = os.path.join(shared_dir, "elsewhere")
    else:
        infini_dist.config.cache_dir = shared_dir
    return tune_once(rank, world_size)


def _only_file(directory):
    (name,) = [n for n in os.listdir(directory) if n.endswith(".json")]
    return os.path.join(directory, name)


def test_corrupt_cache_file_is_rebuilt(tmp_path):
    run_ranks(tune_once, 2, cache_dir=str(tmp_path))
    path = _only_file(tmp_path)
    with open(path, "w") as f:
        f.write("{ not json")
    again = run_ranks(tune_once, 2, cache_dir=str(tmp_path))
    assert [r["misses"] for r in again] == [1, 1]
    record = json.load(open(path))  # rewritten, valid again
    assert isinstance(record["choice"], str)


def test_stale_version_is_ignored(tmp_path):
    run_ranks(tune_once, 2, cache_dir=str(tmp_path))
    path = _only_file(tmp_path)
    record = json.load(open(path))
    record["versions"]["infini_dist"] = "0.0.0-old"
    record["choice"] = "no-such-choice"
    json.dump(record, open(path, "w"))
    again = run_ranks(tune_once, 2, cache_dir=str(tmp_path))
    assert [r["misses"] for r in again] == [1, 1]
    assert json.load(open(path))["versions"]["infini_dist"] != "0.0.0-old"


def mismatched_shapes(rank, world_size):
    from infini_dist.scheduler.control import RankMismatchError
    import infini_dist
    from infini_dist.scheduler.engine import executor_for
    rows = 4 if rank == 0 else 6
    try:
        settings = infini_dist.config.snapshot()
        executor_for(ar_block_graph(), settings).run(inputs_for(rank, rows=rows))
    except RankMismatchError as error:
        return str(error)
    return "no error"


def test_shapes_that_differ_across_ranks_give_a_clear_error():
    messages = run_ranks(mismatched_shapes, 2, timeout=120)
    for message in messages:
        assert "disagree" in message and "Ranks [1]" in message, message
        assert "(4, 16)" in message and "(6, 16)" in message


def unusual_inputs(rank, world_size):
    import infini_dist
    from infini_dist.scheduler.engine import executor_for
    from infini_dist.scheduler.ir import OpNode, SubGraph
    graph = SubGraph((OpNode("all_reduce", ("x",), ("y",)), OpNode("relu", ("y",), ("r",)),
                      OpNode("scale", ("r",), ("out",), {"scale": 3.0})), ("x",), ("out",))
    results = {}
    with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=1):
        executor = executor_for(graph, infini_dist.config.snapshot())
        ints = torch.arange(12, dtype=torch.int64).reshape(3, 4) - 5 + rank
        results["int"] = executor.run({"x": ints})["out"]
        results["int_choice"] = executor.site_runners()[0]._committed
        results["empty"] = executor.run({"x": torch.empty(0, 8)})["out"]
        base = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
        results["noncontig"] = executor.run({"x": base.t()})["out"]  # (6, 8) view, strided
    results["int_choice"] = sorted(c.name for c in results["int_choice"].values())
    return results


def test_int_empty_and_noncontiguous_inputs():
    r0, r1 = run_ranks(unusual_inputs, 2, timeout=120)
    ints = sum(torch.arange(12, dtype=torch.int64).reshape(3, 4) - 5 + r for r in range(2))
    torch.testing.assert_close(r0["int"], torch.relu(ints) * 3.0)  # torch's own promotion
    assert "native" in r0["int_choice"]
    assert r0["empty"].shape == (0, 8)
    base = sum(torch.randn(8, 6, generator=torch.Generator().manual_seed(r)) for r in range(2))
    torch.testing.assert_close(r0["noncontig"], torch.relu(base.t()) * 3)
    assert torch.equal(r0["noncontig"], r1["noncontig"])
