"""launch/step_timing.py's device-only timing (`time_device`) on GPUs: a call whose host takes
ten times its kernel must time as its kernel there, while the interleaved events around each call
(`time_interleaved`) time the host; a call that waits for the device is given up on after three
tries, not timed. Two ranks where there are two GPUs, so the all_reduce that
lines the devices up after each sleep runs too.
"""

import pytest
import torch

from multirank import run_ranks


def timing_worker(rank, world_size):
    import time

    import torch.distributed as dist

    from infini_dist.launch.step_timing import sleep_cycles_for, time_device, time_interleaved
    device = torch.device("cuda", rank)
    control = dist.new_group(backend="gloo")

    class Bench:
        cuda = True

        def __init__(self):
            self.device, self.control = device, control

        def worst(self, value):
            t = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
            return float(t.item())

    cycles, kernel_s = sleep_cycles_for(200e-6, device)

    def host_bound():  # a decode loop's host: ten times the kernel before each launch
        time.sleep(0.002)
        torch.cuda._sleep(cycles)

    def device_bound():
        torch.cuda._sleep(cycles)

    def waits():  # a call that waits for the device: no sleep can get the host ahead
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()

    calls = {"host_bound": host_bound, "device_bound": device_bound, "waits": waits}
    bench = Bench()
    timed = time_interleaved(bench, calls, 2, 5)
    begin = time.perf_counter()
    device_only = time_device(bench, calls, 2, 5, {n: timed[n]["host_us"] for n in calls})
    return dict(kernel_us=bench.worst(kernel_s * 1e6), timed=timed, device=device_only,
                device_s=time.perf_counter() - begin)


@pytest.mark.gpu
def test_device_time_hides_the_host():
    world_size = min(2, torch.cuda.device_count())
    for report in run_ranks(timing_worker, world_size, backend="nccl", timeout=300):
        kernel = report["kernel_us"]
        assert report["timed"]["host_bound"]["call_us"] > 5 * kernel, report  # the host's
        for name in ("host_bound", "device_bound"):
            device = report["device"][name]
            assert device["device_rounds"] == 2 and device["device_rounds_behind"] == 0, device
            # the kernel and a launch gap a call, not the host's 10x (loose: other tests'
            # processes may share the card)
            assert 0.9 * kernel < device["device_us"] < 2 * kernel, (name, report)
            assert device["device_spread"] >= 1.0
        # three tries behind sleeps of about 2 ms x 1, 2 and 4, then never again
        assert report["device"]["waits"] == dict(device_us=None, device_spread=None,
                                                 device_rounds=0, device_rounds_behind=3)
        assert report["device_s"] < 5, report
