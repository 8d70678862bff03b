"""launch/cudagraph_watch.py: cudagraph-tree skips are seen per call, with torch's reasons."""

import torch
from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

from infini_dist.launch.cudagraph_watch import CudagraphWatch


def test_skip_reported_by_torch_is_counted_with_its_reason():
    reason = "skipping cudagraphs due to mutated inputs (1 instances)"
    with CudagraphWatch() as watch:
        assert watch.call(lambda: 7) == 7
        assert watch.report() == {"cudagraphs": True}
        watch.call(lambda: log_cudagraph_skip_and_bump_counter(reason))
    report = watch.report()
    assert report["cudagraphs"] is False and report["cudagraph_skips"] == 1
    assert report["cudagraph_skip_reasons"] == [reason]


def test_skips_outside_its_calls_or_after_detach_are_not_counted():
    with CudagraphWatch() as watch:
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to another variant")
        watch.call(lambda: None)
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a later model")
    assert watch.report() == {"cudagraphs": True} and watch.reasons == []


def test_reduce_overhead_compile_on_cpu_is_a_skip():
    """A real torch.compile: cudagraph trees cannot take a CPU graph and say so."""
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda x: (x * 3).sin(), mode="reduce-overhead", dynamic=False)
        x = torch.randn(8)
        with CudagraphWatch() as watch:
            out = watch.call(lambda: fn(x))
            watch.call(lambda: fn(x))
        torch.testing.assert_close(out, (x * 3).sin())
        report = watch.report()
        assert report["cudagraphs"] is False and report["cudagraph_skips"] == 1, report
    finally:
        torch._dynamo.reset()
