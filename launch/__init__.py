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
