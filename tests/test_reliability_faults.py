"""The fault matrix of issue 12 (items 5-8, 10): group layouts, a broken decision cache, faults
at every tuning step, concurrent tunings, groups over two hosts. Every case records, per rank,
the outcome, the seconds to it and whether the cache on disk is still valid, and asserts a
correct result or the same clear error on every rank within tuning_timeout_s + a few seconds.

Set INFINI_DIST_FAULT_REPORT=path to append the rows (JSON lines) for docs/reliability.md."""

import json
import os
import threading
import time

import pytest
import torch

from faults import Fault, cache_valid, expected_for, install, tune_and_record
from multirank import run_ranks

TIMEOUT_S = 6.0  # tuning_timeout_s in these tests
SLACK_S = 5.0
CLEAR_ERRORS = {"TuningError", "ControlPlaneError", "DataPlaneError", "RankMismatchError"}


def _report(case, world_size, rows):
    path = os.environ.get("INFINI_DIST_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, "ranks": world_size, "rows": rows}) + "\n")


def _check(case, world_size, rows, expect):
    """expect: 'ok' (right answer, the same non-faulty choice everywhere) or an error name that
    every surviving rank must raise."""
    _report(case, world_size, rows)
    alive = [r for r in rows if r is not None]
    for row in alive:
        assert row["seconds"] < TIMEOUT_S + SLACK_S, (case, row)
        assert row["cache_valid"], (case, row)
    outcomes = {r["outcome"] for r in alive}
    if expect == "ok":
        assert outcomes == {"ok"}, (case, alive)
        choices = {r["message"] for r in alive}
        assert len(choices) == 1 and not choices.pop().startswith("faulty"), (case, alive)
    else:
        assert outcomes <= CLEAR_ERRORS and len(outcomes) == 1, (case, alive)
        assert all("step" in r["message"] for r in alive), (case, alive)
        if expect != "clear error":
            assert outcomes == {expect}, (case, alive)


def _settings(**overrides):
    import infini_dist
    with infini_dist.config.patch(tuning_timeout_s=TIMEOUT_S, benchmark_warmup=1,
                                  benchmark_reps=3, **overrides):
        return infini_dist.config.snapshot()


# ---- item 7: a fault at every tuning step ----------------------------------------------------
# (fault, outcome): a fault after the collective is dropped everywhere; one before it leaves
# the peers waiting in their collective, so every rank fails with a clear error.
TUNING_FAULTS = [
    (dict(step="precompile"), "ok"),
    (dict(step="trial"), "ok"),
    (dict(step="trial", kind="wrong"), "ok"),
    (dict(step="warmup"), "ok"),
    (dict(step="rep", rep=1), "ok"),
    (dict(step="rep", rep=3), "ok"),
    (dict(step="rep", rep=2, ranks=(0,)), "ok"),
    (dict(step="trial", before=True), "TuningError"),
    (dict(step="warmup", before=True), "TuningError"),
    (dict(step="rep", rep=2, before=True), "TuningError"),
    # the last rep on rank 0: only a peer sees the data-plane timeout, and that must count
    (dict(step="rep", rep=3, before=True, ranks=(0,)), "TuningError"),
]


def tuning_faults(rank, world_size, cases):
    import torch.distributed as dist

    import infini_dist
    from infini_dist.scheduler.cache import DECISIONS
    rows = []
    for i, (fault_args, _) in enumerate(cases):
        DECISIONS.clear()  # and a cache dir per case: every case tunes
        # A fresh data group per case: a fault before a collective leaves its group out of step.
        group = dist.new_group(list(range(world_size)))
        undo = install(Fault(**fault_args), warmup=1, group_rank=rank)
        try:
            settings = _settings(cache_dir=os.path.join(infini_dist.config.cache_dir, str(i)))
            rows.append(tune_and_record(rank, group, list(range(world_size)), settings))
        finally:
            undo()
    return rows


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_fault_at_any_tuning_step_is_agreed(world_size):
    results = run_ranks(tuning_faults, world_size, TUNING_FAULTS, timeout=600)
    for i, (fault_args, expect) in enumerate(TUNING_FAULTS):
        _check(repr(Fault(**fault_args)), world_size, [r[i] for r in results], expect)


def dying_rank(rank, world_size, fault_args):
    undo = install(Fault(**fault_args), warmup=1, group_rank=rank)
    try:
        return tune_and_record(rank, None, list(range(world_size)), _settings())
    finally:
        undo()


@pytest.mark.parametrize("world_size,fault_args", [
    (2, dict(step="rep", rep=2, kind="exit", before=True)),
    (3, dict(step="rep", rep=2, kind="exit")),
    (3, dict(step="vote", kind="exit")),
])
def test_a_rank_that_dies_while_tuning_gives_its_peers_a_clear_error(world_size, fault_args):
    rows = run_ranks(dying_rank, world_size, fault_args, timeout=120, partial=True)
    assert rows[1] is None  # it died
    _check(repr(Fault(**fault_args)), world_size, rows, "ControlPlaneError")


def absent_then_back(rank, world_size):
    import infini_dist
    from infini_dist.scheduler.cache import DECISIONS
    rows = []
    for i, present in enumerate((True, rank == 0, True)):
        DECISIONS.clear()
        settings = _settings(cache_dir=os.path.join(infini_dist.config.cache_dir, str(i)))
        if present:
            rows.append(tune_and_record(rank, None, list(range(world_size)), settings))
        else:  # skips the call: rank 0 fails alone and abandons the plane
            time.sleep(TIMEOUT_S + 2)
            rows.append(None)
    return rows


def test_a_group_meets_again_after_a_rank_skipped_a_tuning():
    results = run_ranks(absent_then_back, 2, timeout=180)
    _check("tuned", 2, [r[0] for r in results], "ok")
    assert results[0][1]["outcome"] == "ControlPlaneError" and results[1][1] is None
    _check("rank 0 alone, then both again", 2, [r[2] for r in results], "ok")


# ---- item 5: any sequence of calls on any groups ----------------------------------------------
def group_sequence(rank, world_size, layout):
    import torch.distributed as dist
    rows = []
    for action, ranks in layout:
        members = list(ranks or range(world_size))
        group = dist.new_group(members) if ranks else None  # collective: every rank creates it
        if action == "use" and rank in members:
            row = tune_and_record(rank, group, members, _settings())
            rows.append(dict(row, group=members))
    return rows


GROUP_LAYOUTS = {
    "[0,1] then WORLD": (3, [("use", (0, 1)), ("use", None)]),
    "[0,1] then [1,2]": (3, [("use", (0, 1)), ("use", (1, 2))]),
    "[0,1] created unused, then WORLD": (3, [("create", (0, 1)), ("use", None)]),
    "mixed on 4": (4, [("use", (0, 1)), ("use", (2, 3)), ("create", (1, 2)), ("use", None),
                       ("use", (0, 2, 3)), ("use", (1, 3)), ("use", (0, 1)), ("use", None)]),
}


@pytest.mark.parametrize("name", sorted(GROUP_LAYOUTS))
def test_any_sequence_of_groups_works(name):
    world_size, layout = GROUP_LAYOUTS[name]
    results = run_ranks(group_sequence, world_size, layout, timeout=300)
    uses = [ranks or tuple(range(world_size)) for action, ranks in layout if action == "use"]
    for rank, rows in enumerate(results):
        assert [tuple(r["group"]) for r in rows] == [u for u in uses if rank in u]
    per_rank = [iter(rows) for rows in results]
    for use in uses:
        rows = [next(per_rank[rank]) for rank in use]
        _check(f"groups {name}: {list(use)}", world_size, rows, "ok")


# ---- item 6: any content or file type where a cache record should be ------------------------
def _corrupt(path, kind):
    os.remove(path)
    if kind == "deep JSON":
        with open(path, "w") as f:
            f.write("[" * 200_000 + "]" * 200_000)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "binary garbage":
        with open(path, "wb") as f:
            f.write(bytes(range(256)) * 7)
    elif kind == "2 MB file":
        with open(path, "w") as f:
            f.write(" " * (2 << 20) + "{}")
    elif kind == "JSON of the wrong type":
        with open(path, "w") as f:
            f.write('{"choice": 5, "versions": []}')
    elif kind == "empty file":
        open(path, "w").close()


CACHE_KINDS = ["deep JSON", "directory", "FIFO", "symlink to /dev/zero", "binary garbage",
               "2 MB file", "JSON of the wrong type", "empty file"]


def cache_cases(rank, world_size, kinds):
    import shutil
    import warnings

    import infini_dist
    from infini_dist.scheduler.cache import DECISIONS
    from infini_dist.scheduler.control import control_plane
    plane = control_plane(None, TIMEOUT_S)
    cache_dir = infini_dist.config.cache_dir
    rows = []
    for kind in kinds:
        DECISIONS.clear()
        tune_and_record(rank, None, list(range(world_size)), _settings())  # writes the record
        plane.barrier("record written")
        if rank == 0:
            (name,) = [n for n in os.listdir(cache_dir) if n.endswith(".json")]
            path = os.path.join(cache_dir, name)
            _corrupt(path, kind)
        plane.barrier("record corrupted")
        DECISIONS.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row = tune_and_record(rank, None, list(range(world_size)), _settings())
        row["warned"] = any("cache file" in str(w.message) for w in caught)
        rows.append(row)
        plane.barrier("case done")
        if rank == 0:  # start the next kind from an empty cache dir
            shutil.rmtree(cache_dir)
        plane.barrier("cache cleared")
    return rows


@pytest.mark.parametrize("world_size", [2, 3])
def test_any_cache_file_content_or_type_is_survived(world_size):
    results = run_ranks(cache_cases, world_size, CACHE_KINDS, timeout=600)
    for i, kind in enumerate(CACHE_KINDS):
        rows = [r[i] for r in results]
        _check(f"cache: {kind}", world_size, rows, "ok")
        assert rows[0]["warned"], (kind, rows[0])


def test_cache_validity_check_can_fail(tmp_path):
    assert cache_valid(tmp_path)
    (tmp_path / "a.json").write_text("{ nope")
    assert not cache_valid(tmp_path)
    (tmp_path / "a.json").write_text('{"choice": "native"}')
    assert cache_valid(tmp_path)
    (tmp_path / ".a.123.tmp").write_text("")
    assert not cache_valid(tmp_path)


# ---- item 8: two threads tuning different sites on one group ---------------------------------
def _second_graph():
    from infini_dist.scheduler.ir import OpNode, SubGraph
    return SubGraph((OpNode("all_reduce", ("x",), ("y",)), OpNode("relu", ("y",), ("r",)),
                     OpNode("scale", ("r",), ("out",), {"scale": 3.0})), ("x",), ("out",))


def two_threads(rank, world_size, crossed):
    from infini_dist.scheduler import engine
    from test_engine_consensus import ar_block_graph, inputs_for
    settings = _settings()
    x = inputs_for(rank)["x"]
    total = sum(inputs_for(r)["x"] for r in range(world_size))
    jobs = {"block": (ar_block_graph(), inputs_for(rank),
                      lambda out: torch.allclose(out["act"].double(),
                                                 expected_for(range(world_size))[0], atol=1e-5)),
            "relu": (_second_graph(), {"x": x},
                     lambda out: torch.allclose(out["out"], torch.relu(total) * 3.0, atol=1e-5))}
    rows = {}

    def work(name, key=None):
        graph, inputs, right = jobs[name]
        started = time.monotonic()
        try:
            out = engine.GraphExecutor(graph, settings).run(inputs)
            outcome, message = ("ok" if right(out) else "WRONG"), ""
        except Exception as error:  # noqa: BLE001 - recorded
            outcome, message = type(error).__name__, str(error)
        rows[key or name] = {"rank": rank, "outcome": outcome, "message": message,
                      "seconds": time.monotonic() - started,
                      "cache_valid": cache_valid(settings.cache_dir)}
    order = ["block", "relu"] if not crossed or rank == 0 else ["relu", "block"]
    threads = []
    for name in order:
        threads.append(threading.Thread(target=work, args=(name,)))
        threads[-1].start()
        time.sleep(0.5)  # the first thread takes the plane first
    for thread in threads:
        thread.join()
    work("block", "after")  # afterwards the plane still works, one call at a time
    return rows


@pytest.mark.parametrize("crossed", [False, True])
def test_two_threads_tuning_on_one_group(crossed):
    results = run_ranks(two_threads, 2, crossed, timeout=180)
    for name in ("block", "relu", "after"):
        rows = [r[name] for r in results]
        expect = "ok" if name == "after" or not crossed else "RankMismatchError"
        _check(f"threads ({'crossed' if crossed else 'same'} order): {name}", 2, rows, expect)


# ---- item 10: a group over two hosts ----------------------------------------------------------
def two_hosts(rank, world_size, hosts):
    import infini_dist
    from infini_dist.scheduler import engine
    from infini_dist.scheduler.choices import register_algorithm
    from infini_dist.scheduler.torch_fused import TorchFusedAllReduce
    from test_engine_consensus import ar_block_graph, inputs_for

    class NvlinkOnly(TorchFusedAllReduce):
        name = "nvlink_only"

        def supports(self, span, meta, ctx):
            return ctx.single_host and super().supports(span, meta, ctx)
    register_algorithm("all_reduce", "cpu", NvlinkOnly())
    os.environ["INFINI_DIST_HOST_ID"] = hosts[rank]
    with infini_dist.config.patch(tuning_timeout_s=TIMEOUT_S, benchmark_warmup=0,
                                  benchmark_reps=1):
        executor = engine.executor_for(ar_block_graph(), infini_dist.config.snapshot())
        executor.run(inputs_for(rank))
    return executor.site_runners()[0].last_tuning["candidates"]


@pytest.mark.parametrize("hosts,offered", [(("a", "b"), False), (("a", "a"), True)])
def test_nvlink_only_choices_need_one_host(hosts, offered):
    candidates = run_ranks(two_hosts, 2, hosts, timeout=120)
    assert candidates[0] == candidates[1]
    assert any(c.startswith("nvlink_only") for c in candidates[0]) == offered, candidates[0]


def test_symm_plan_refuses_a_group_over_hosts():
    from infini_dist.scheduler.backends.symm import plan_span
    from infini_dist.scheduler.choices import FusedSpan, RunContext, TensorMeta
    from test_engine_consensus import ar_block_graph
    graph = ar_block_graph()
    device = torch.device("cuda", 0)  # only described, never touched
    meta = {n: TensorMeta((16,) if n == "w" else (4, 16), torch.bfloat16, device, True)
            for n in ("x", "xs", "y", "res", "w", "out", "res_out", "act")}
    span = FusedSpan(graph, (), (1,), (2,))
    assert plan_span(span, meta, RunContext(None, 2, 0, device)) is not None
    assert plan_span(span, meta, RunContext(None, 2, 0, device, single_host=False)) is None
