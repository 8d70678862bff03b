"""All-gather, A/B: our Lamport all-gather (kernels/lamport_all_gather.py, the engine's
`lamport_all_gather`), with and without programmatic dependent launch, against NCCL's
all_gather_into_tensor, under CUDA-graph replay (10 calls a graph, µs per call, max over
ranks), in the order NCCL, ours, ours PDL, ours PDL, ours, NCCL (each side's mean).

Shapes: the logits a TP model gathers over the vocabulary in every step (rows x 16000 bf16, a
32000 vocabulary on 2 ranks; rows = the decode batch, with logits of the last token only), and
hidden-4096 activations of 1024 tokens (8 MiB a rank, the engine's cap for this kernel). Every
gather of ours is checked for NCCL's bits, eagerly and after the replays.

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_gather \\
        [--rows 1,8,32,128]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from infini_dist.kernels.lamport_all_gather import lamport_all_gather
from infini_dist.kernels.symm_device import SymmTuning
from infini_dist.launch.arguments import nonempty_ints
from infini_dist.launch.bench import Timer

VOCAB_SHARD = 16000


def _input(shape, device) -> torch.Tensor:
    """Random bf16 with no zero (a -0.0 would arrive as +0.0: the check is bitwise)."""
    t = torch.randn(shape, device=device, dtype=torch.float32)
    return (t.sign() * (0.01 + t.abs())).to(torch.bfloat16)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=nonempty_ints, default="1,8,32,128",
                        help="logits rows (decode batches) to gather, x 16000 bf16 a rank")
    args = parser.parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    timer = Timer(device, 5, 20, graph_calls=10)
    shapes = [(rows, VOCAB_SHARD) for rows in args.rows] + [(1024 // world, 4096 * world)]
    table = []
    for shape in shapes:
        x = _input(shape, device)
        nccl_out = torch.empty((world * shape[0],) + shape[1:], dtype=x.dtype, device=device)
        calls = {"nccl": lambda: dist.all_gather_into_tensor(nccl_out, x)}
        outputs = {}
        for name, pdl in (("ours", False), ("ours, PDL", True)):
            tuning, outputs[name] = SymmTuning(pdl=pdl), torch.empty_like(nccl_out)
            calls[name] = (lambda out=outputs[name], tuning=tuning:
                           lamport_all_gather(x, out=out, tuning=tuning))
            calls[name]()  # the buffer, made eagerly
        calls["nccl"]()
        torch.cuda.synchronize()

        def check(when):
            for name, out in outputs.items():
                if not torch.equal(out.view(torch.int16), nccl_out.view(torch.int16)):
                    raise SystemExit(f"{name}, {shape}{when}: not NCCL's bits")
        check("")
        times = {name: [] for name in calls}
        for name in ("nccl", "ours", "ours, PDL", "ours, PDL", "ours", "nccl"):
            times[name].append(timer.graph(calls[name]) * 1e6)
        check(", replayed")  # what the replays wrote
        means = {name: sum(v) / len(v) for name, v in times.items()}
        table.append((shape, x.numel() * x.element_size(), means))
        if dist.get_rank() == 0:
            print(f"{shape}: " + ", ".join(f"{n} {v:.2f}" for n, v in means.items()), flush=True)
    if dist.get_rank() == 0:
        print(f"\n{world} ranks, {torch.cuda.get_device_name(device)}; µs per call, graph replay, "
              "10 calls a graph, max over ranks\n\n| shape a rank | KiB a rank | NCCL | ours | "
              "ours, PDL | NCCL / ours, PDL |\n|---|---|---|---|---|---|")
        for shape, size, m in table:
            print(f"| {shape[0]} x {shape[1]} | {size / 1024:.0f} | {m['nccl']:.2f} | "
                  f"{m['ours']:.2f} | {m['ours, PDL']:.2f} | {m['nccl'] / m['ours, PDL']:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
