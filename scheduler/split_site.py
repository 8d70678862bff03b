"""One site of a row-split chain (scheduler/split_chain.py): a row-parallel GEMM, its all-reduce
+ residual add + RMSNorm, and the GEMMs that read the norm, with the all-reduce split into a
reduce-scatter and an all-gather that copy engines carry under the GEMMs on either side.

Unfused torch equivalent (x [rows, K] this rank's GEMM input, w its weight shard):
    y = x @ w.T;  dist.all_reduce(y);  pre = y + residual;  h = rms_norm(pre) * norm_weight
    outs = [h @ r.T (+ bias) for r in readers]

At W ranks the rows are cut into W parts; rank p owns part p.
  produce  the peers' parts of the GEMM first, each pushed by copy engine into slot `rank` of
           its owner's buffer while the next part computes; this rank's own part last, into its
           own slot. The copy stream then sets this rank's flag in every peer (a stream memory
           operation, kernels/cuda_driver.py); the compute stream waits for the peers' flags
           (kernels/chunk_reduce.flag_wait_launch) and reduces its own rows alone: the W slots
           summed in rank order + add + RMSNorm (kernels/chunk_reduce.py), into its rows of
           the gathered buffer `h`. Then the copy stream pushes those rows into every peer's
           `h`, and flags them.
  read     the readers' GEMMs over this rank's rows, then a wait for the peers' flags, then the
           other rows: the gather hides under the first half.
Only this rank's rows of `pre` (the new residual) are written: the next site of the chain adds
only those. Each row is reduced by one rank and copied, so every rank holds the same bits.

Reuse without barriers: a rank writes a peer's slot or rows of site k again only in a later
forward, after waits that the peer's own later signals satisfied, which it sent after reading
them; each flag is set again only after its owner cleared it (docs/notes_symm.md, session 31).
The same holds two sites on: a rank writes site k + 2's slots and rows after its reduction of
site k + 1, which waited for the peers' site k + 1 signals, sent after their reads of site k.
So sites k and k + 2 share every buffer, and a chain holds two sets of them, not one a site.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from infini_dist.kernels import cuda_driver, symm_buffers
from infini_dist.kernels.chunk_reduce import (chunk_reduce_bytes, chunk_reduce_launches,
                                               flag_wait_launch)
from infini_dist.kernels.symm_buffers import slot_elements
from infini_dist.kernels.symm_call import norm_options


def row_parts(rows: int, world: int, rank: int) -> tuple[slice, list[slice]]:
    """(this rank's rows, the other ranks' rows in the order a producer computes them: rank + 1,
    rank + 2, ..., so that no two ranks push to the same peer at once)."""
    if rows % world:
        raise ValueError(f"row split: {rows} rows do not cut into {world} parts")
    n = rows // world
    parts = [slice(p * n, (p + 1) * n) for p in range(world)]
    return parts[rank], [parts[(rank + i) % world] for i in range(1, world)]


def launch(kernel_launch) -> None:
    kernel, grid, args, kwargs = kernel_launch
    kernel[grid](*args, **kwargs)


def gemm(x, weight, transpose: bool, bias=None, out=None):
    """x @ weight.T (transpose: weight [N, K], as nn.Linear holds it) or x @ weight, + bias."""
    w = weight.t() if transpose else weight
    if bias is None:
        return torch.mm(x, w, out=out)
    return torch.addmm(bias, x, w, out=out)


class Flags:
    """One int32 per (site, phase: 0 the scatter, 1 the gather, source rank) in every rank's
    symmetric buffer, set to 1 by the source's copy stream after its copies and cleared by this
    rank's compute stream once seen. `plane`: the control plane (a barrier after zeroing)."""

    def __init__(self, group, device, sites: int, plane, tuning):
        self.driver = cuda_driver.driver()
        if self.driver is None:
            raise RuntimeError("row split: the flags need libcuda")
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.tuning = tuning
        count = sites * 2 * self.world
        buffer = symm_buffers.get_buffer(group, device, "row_split_flags", count * 4)
        views = [symm_buffers.data_view(buffer, r, torch.int32, 0, count)
                 for r in range(self.world)]
        views[self.rank].zero_()
        torch.cuda.synchronize(device)
        if plane is not None:
            plane.barrier("row split flags")  # every rank's flags clear before any peer sets one
        else:
            dist.barrier(group)
        self.bases = [v.data_ptr() for v in views]
        self.mine = views[self.rank]

    def _first(self, k, phase):
        """Where (site k, phase)'s flags start, one per source rank."""
        return (k * 2 + phase) * self.world

    def signal(self, k, phase):
        """On the current stream (the copy stream): set this rank's flag in every peer."""
        stream = torch.cuda.current_stream().cuda_stream
        for i in range(1, self.world):
            peer = (self.rank + i) % self.world
            address = self.bases[peer] + 4 * (self._first(k, phase) + self.rank)
            self.driver.write_value(stream, address, 1)

    def wait(self, k, phase):
        """On the current stream: wait for every peer's flag here, then clear it."""
        first = self._first(k, phase)
        launch(flag_wait_launch(self.mine[first:first + self.world], self.rank, self.world,
                                self.tuning))


class SplitSite:
    """Site `index` of a chain for `rows` x `hidden` values of `dtype`, its buffers sized once.
    `copy_stream` and `flags` are the chain's; the chain joins the copy stream at its end.
    `like`: site index - 2, whose buffers this site shares (see the module doc)."""

    def __init__(self, index: int, rows: int, hidden: int, dtype, group, device,
                 copy_stream, flags: Flags, tuning, like: "SplitSite | None" = None):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.index, self.rows, self.tuning = index, rows, tuning
        self.copy_stream, self.flags = copy_stream, flags
        self.own, self.others = row_parts(rows, world, rank)
        n = rows // world
        numel = n * hidden
        stride = slot_elements(numel)
        if stride != numel:
            raise ValueError("row split: the gathered parts must lie back to back")
        size = chunk_reduce_bytes(numel, dtype.itemsize, world)
        if like is not None and (like.rows, like.pre.shape[1], like.pre.dtype) != (rows, hidden,
                                                                                  dtype):
            raise ValueError("row split: sites sharing buffers differ in size")
        self.scatter = symm_buffers.get_buffer(group, device, f"row_split_scatter{index % 2}",
                                               size)
        gather = symm_buffers.get_buffer(group, device, f"row_split_gather{index % 2}", size)
        self.y = symm_buffers.data_view(self.scatter, rank, dtype, rank * stride,
                                        numel).view(n, hidden)
        self.pushes = [  # (the part computed here, its owner's slot for it)
            (like.pushes[i - 1][0] if like else torch.empty(n, hidden, dtype=dtype,
                                                            device=device),
             symm_buffers.data_view(self.scatter, (rank + i) % world, dtype, rank * stride,
                                    numel).view(n, hidden)) for i in range(1, world)]
        self.h = symm_buffers.data_view(gather, rank, dtype, 0, rows * hidden).view(rows, hidden)
        self.gathers = [t.view(n, hidden) for t in symm_buffers.peer_views(
            gather, dtype, rank * stride, numel)]
        # The new residual: kept, like h, so that the next site's reduction reads the same
        # address at every call and its launch is bound once.
        self.pre = like.pre if like else torch.empty(rows, hidden, dtype=dtype, device=device)
        # How many readers (the first ones) run in row parts around the gather's wait; the
        # rest run over every row after it: enough parts to hide the gather, no more GEMMs
        # than that. None: all. `columns`: each part's GEMM in that many column parts, as
        # cuBLAS is slower on some half-row shapes than on the same work cut again by columns
        # (1024 x 4096 x 7168 bf16 on H200: 201 us in two row parts, 160 in four). The chain
        # times both per site.
        self.parted = None
        self.columns = 1
        self._bound = None  # ((residual, weight) pointers and eps, the reduction's launch)

    def _reduction(self, residual, weight, eps: float, keep: bool):
        """The reduction's launch. keep: `residual` is another site's kept `pre`, so the launch
        may be kept too; else it is bound for this call alone (a launch keeps its tensors
        alive, and a call's own tensors must not outlive it: CUDA-graph trees check that)."""
        key = (residual.data_ptr(), weight.data_ptr(), eps)
        if self._bound is not None and self._bound[0] == key:
            return self._bound[1]
        (launches,) = chunk_reduce_launches(
            self.y, self.scatter, self.h[self.own], [(0, self.y.numel())],
            pre=self.pre[self.own], eps=eps, tuning=self.tuning,
            **norm_options(self.y, "rms_norm", weight, None, residual))
        if keep:
            self._bound = (key, launches[1])
        return launches[1]  # the barriers are the flags' to do

    def produce(self, x, weight, transpose: bool, residual, norm_weight, eps: float,
                keep: bool = False):
        """(h: every row, the peers' still arriving; pre: this rank's rows written) for x
        [rows, K] and residual [rows, hidden] (this rank's rows read); keep: see _reduction."""
        caller = torch.cuda.current_stream()
        for rows, (part, target) in zip(self.others, self.pushes):
            gemm(x[rows], weight, transpose, out=part)
            self.copy_stream.wait_stream(caller)
            with torch.cuda.stream(self.copy_stream):
                target.copy_(part)
        with torch.cuda.stream(self.copy_stream):
            self.flags.signal(self.index, 0)
        gemm(x[self.own], weight, transpose, out=self.y)
        reduction = self._reduction(residual[self.own], norm_weight, eps, keep)
        self.flags.wait(self.index, 0)
        launch(reduction)
        self.copy_stream.wait_stream(caller)
        with torch.cuda.stream(self.copy_stream):
            mine = self.h[self.own]
            for target in self.gathers:
                target.copy_(mine)
            self.flags.signal(self.index, 1)
        return self.h, self.pre

    def read(self, readers) -> list:
        """The GEMMs reading h: readers = [(weight, transpose, bias)], the first `parted` of them
        over this rank's rows first. No readers: a copy of h once every row has arrived."""
        if not readers:
            self.flags.wait(self.index, 1)
            return [self.h.clone()]
        parted = readers[:self.parted]
        outs = [torch.empty(self.rows, w.shape[0] if t else w.shape[1], dtype=self.h.dtype,
                            device=self.h.device) for w, t, _ in parted]
        self._read_rows(self.own, parted, outs)
        self.flags.wait(self.index, 1)
        for rows in self.others:
            self._read_rows(rows, parted, outs)
        return outs + [gemm(self.h, w, t, b) for w, t, b in readers[len(parted):]]

    def _read_rows(self, rows, readers, outs) -> None:
        for (weight, transpose, bias), out in zip(readers, outs):
            n = out.shape[1]
            for c in range(self.columns):
                cols = slice(c * n // self.columns, (c + 1) * n // self.columns)
                gemm(self.h[rows], weight[cols] if transpose else weight[:, cols], transpose,
                     None if bias is None else bias[cols], out=out[rows, cols])
