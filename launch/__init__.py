"""torchrun entry points and the infini-dist CLI."""


def shutdown():
    """End a torchrun job: every rank done, then infini_dist's control groups, then the job's.

    Control groups left to interpreter teardown can abort a process while gloo's threads are
    still connected to peers."""
    import torch.distributed as dist

    from infini_dist.scheduler.control import reset_control_planes
    dist.barrier()
    reset_control_planes()
    dist.destroy_process_group()


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
