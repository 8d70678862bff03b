"""torchrun entry points and the infini-dist CLI."""


SHUTDOWN_LIMIT_S = 120  # a teardown that waits this long is stuck: its stacks, then exit 1


def shutdown():
    """End a torchrun job: CUDA graphs released, every rank done, then infini_dist's control
    groups, then the job's.

    A CUDA graph that captured an NCCL collective keeps the communicator busy, and
    destroy_process_group then waits in ncclCommDestroy for good (pytorch/pytorch#115388): an HF
    generate() job under reduce-overhead wrote its result and never exited. Control groups left
    to interpreter teardown can abort a process while gloo's threads are still connected to
    peers. Whatever else hangs here prints every thread's stack and ends the process."""
    import faulthandler
    import gc

    import torch
    import torch.distributed as dist

    from infini_dist.scheduler.control import reset_control_planes
    faulthandler.dump_traceback_later(SHUTDOWN_LIMIT_S, exit=True)
    torch._dynamo.reset()  # drops the cudagraph trees, and with them their captured collectives
    gc.collect()  # graphs a job captured itself, once nothing refers to them
    dist.barrier()
    reset_control_planes()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def init_job():
    """Join the torchrun job: NCCL on this rank's GPU in bf16, else gloo on CPU in fp32.
    Returns (device, dtype)."""
    import os

    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    return (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
