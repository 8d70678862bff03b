"""The TP decoder's forward with each all-reduce split into a reduce-scatter and an all-gather that
copy engines carry under the GEMMs on either side of the site: the `rs_ag` variant of
launch/bench_microbatch.py (issue #26 item 4: prefill ≤ 1.05× the collective-free step).

At W ranks the batch's rows are cut into W parts; rank p owns part p. Per site:
  producer  the GEMM before the site (o_proj, down) computes the peers' parts first, and a copy
            engine pushes each into slot `rank` of its owner's buffer while the next part
            computes; this rank's own part last, into its own slot. Then, on the copy stream, a
            barrier: every rank's pushes have landed.
  reduce    this rank's rows alone (kernels/chunk_reduce.py: the W slots summed in rank order +
            add + RMSNorm), into this rank's part of a gathered buffer. The residual stream stays
            this rank's rows: the next site adds only those.
  consumer  a copy engine pushes the reduced rows into every peer's gathered buffer, then a
            barrier, while the GEMM after the site (qkv, gate_up) computes this rank's own rows;
            then its other rows.
So of each site's transfers only what outlasts half a GEMM stays exposed, at the price of every
GEMM next to a site in W row parts. `floor_rs_ag` is the same forward without communication:
the same GEMM parts, and the floor's reduction (this rank's values alone) over every row.

Every site has buffers of its own, so no barrier closes a site: a rank rewrites a peer's slot of
site k only in a later forward, after barriers that the peer passed after reading it.

`rs_ag_spin` is `rs_ag` with each barrier kernel replaced by half a barrier: after its copies
the copy stream sets a flag in every peer by a stream memory operation (kernels/cuda_driver.py,
cuStreamWriteValue32), and the compute stream waits for the peers' flags with a one-program
kernel right before the reduction or the consumer's other rows (chunk_reduce.flag_wait_launch),
which clears them. No barrier kernel, and the copy stream joins the forward once, at its end
(session 31: the join and the barrier kernel on the copy stream cost 6-16 µs a site; a stream's
own wait, cuStreamWaitValue32, cost about 7 µs even with its flag already set). The flags are
per site, phase and source; a flag is set again only in the next forward, after its reader
cleared it (the same argument as the buffers').
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from infini_dist.kernels import symm_buffers
from infini_dist.kernels.chunk_reduce import (barrier_launch, chunk_reduce_bytes,
                                               chunk_reduce_launches)
from infini_dist.kernels.symm_buffers import slot_elements
from infini_dist.kernels.symm_call import norm_options
from infini_dist.kernels.symm_device import DEFAULT_TUNING
from infini_dist.launch.tp_decoder import rms_norm
from infini_dist.scheduler.split_site import Flags, launch, row_parts

NAMES = ("floor_rs_ag", "rs_ag", "rs_ag_spin")


def attention_core(layer, qkv):
    """tp_decoder.Layer.attention (causal prefill) between its two GEMMs: the qkv projection
    (b, s, ·) in, the o_proj GEMM's input (b * s, ·) out."""
    b, s, _ = qkv.shape
    d, kvh = layer.head_dim, layer.kv_heads
    q, k, v = qkv.split([layer.q_heads * d, kvh * d, kvh * d], dim=-1)
    q = q.view(b, s, layer.q_heads, d).transpose(1, 2)
    group = layer.q_heads // kvh
    k = k.view(b, s, kvh, d).transpose(1, 2).repeat_interleave(group, dim=1)
    v = v.view(b, s, kvh, d).transpose(1, 2).repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(b * s, -1)


def mlp_core(layer, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def stage_weights(model, k) -> tuple:
    """Stage k's (consumer GEMM weight, producer GEMM weight, core): attention at even k, the MLP
    at odd k."""
    layer = model.layers[k // 2]
    if k % 2 == 0:
        return layer.wqkv, layer.wo, attention_core
    return layer.w_gate_up, layer.w_down, mlp_core


class RowSplit:
    """A bound forward (`floor_rs_ag` or `rs_ag`); calling it runs one forward and returns the
    last norm's output, every row."""

    def __init__(self, name, model, x, norms, group, device):
        """norms: the norm weight after each stage (bench_microbatch.stage_norms)."""
        if name not in NAMES:
            raise ValueError(f"row split: {name!r} is none of {NAMES}")
        self.model, self.x = model, x
        self.communicate = not name.startswith("floor")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.flags = (Flags(group, device, len(norms), None, DEFAULT_TUNING)
                      if name == "rs_ag_spin" else None)
        rows, hidden = x.shape[0] * x.shape[1], x.shape[2]
        self.own, self.others = row_parts(rows, world, rank)
        n = rows // world
        self.copy_stream = torch.cuda.Stream(device) if self.communicate else None
        self.h0 = torch.empty(rows, hidden, dtype=x.dtype, device=device)
        residual = x.reshape(rows, hidden)
        if self.communicate:
            residual = residual[self.own]
        self.mids, self.stages = [], []
        for k, weight in enumerate(norms):
            consumer, _, _ = stage_weights(model, k)
            self.mids.append(torch.empty(rows, consumer.shape[0], dtype=x.dtype, device=device))
            stage = {}
            if self.communicate:
                numel = n * hidden
                stride = slot_elements(numel)
                if stride != numel:
                    raise ValueError("row split: the gathered parts must lie back to back")
                size = chunk_reduce_bytes(numel, x.element_size(), world)
                scatter = symm_buffers.get_buffer(group, device, f"row_split_scatter{k}", size)
                gather = symm_buffers.get_buffer(group, device, f"row_split_gather{k}", size)
                y = symm_buffers.data_view(scatter, rank, x.dtype, rank * stride,
                                           numel).view(n, hidden)
                stage["pushes"] = [  # (the part computed here, its owner's slot for it)
                    (torch.empty(n, hidden, dtype=x.dtype, device=device),
                     symm_buffers.data_view(scatter, (rank + i) % world, x.dtype, rank * stride,
                                            numel).view(n, hidden)) for i in range(1, world)]
                stage["h"] = symm_buffers.data_view(gather, rank, x.dtype, 0,
                                                    rows * hidden).view(rows, hidden)
                stage["gathers"] = [t.view(n, hidden) for t in symm_buffers.peer_views(
                    gather, x.dtype, rank * stride, numel)]
                stage["gathered"] = barrier_launch(gather, True)
                out, reduce_buffer = stage["h"][self.own], scatter
            else:
                y = torch.empty(rows, hidden, dtype=x.dtype, device=device)
                out = stage["h"] = torch.empty_like(y)
                reduce_buffer = symm_buffers.local_scratch(1, 0, chunk_reduce_bytes(
                    y.numel(), x.element_size(), 1), device)
            stage["y"] = y
            pre = torch.empty_like(y)
            (launches,) = chunk_reduce_launches(
                y, reduce_buffer, out, [(0, y.numel())], pre=pre,
                **norm_options(y, "rms_norm", weight, None, residual))
            stage["scattered"], stage["reduce"] = launches[:2]  # not the closing barrier
            residual = pre
            self.stages.append(stage)
        self.gathered = None  # waits for the last gather's rows: what the next consumer calls

    def _consumer(self, k, h):
        """Stage k's first GEMM, this rank's rows first, then the core between the GEMMs (over
        every row: computed per part, the peers' first, it cost more than it hid, session 30)."""
        weight, _, core = stage_weights(self.model, k)
        mid, layer = self.mids[k], self.model.layers[k // 2]
        torch.mm(h[self.own], weight.t(), out=mid[self.own])
        if self.gathered is not None:  # the peers' rows of h
            self.gathered()
        for rows in self.others:
            torch.mm(h[rows], weight.t(), out=mid[rows])
        return core(layer, mid.view(*self.x.shape[:2], -1) if k % 2 == 0 else mid)

    def _producer(self, k, core):
        """Stage k's last GEMM, the peers' parts first, each pushed to its owner as it is made."""
        _, weight, _ = stage_weights(self.model, k)
        stage = self.stages[k]
        if not self.communicate:
            for rows in self.others + [self.own]:
                torch.mm(core[rows], weight.t(), out=stage["y"][rows])
            return
        caller = torch.cuda.current_stream()
        for rows, (part, target) in zip(self.others, stage["pushes"]):
            torch.mm(core[rows], weight.t(), out=part)
            self.copy_stream.wait_stream(caller)
            with torch.cuda.stream(self.copy_stream):
                target.copy_(part)
        with torch.cuda.stream(self.copy_stream):
            if self.flags:
                self.flags.signal(k, 0)
            else:
                launch(stage["scattered"])
        torch.mm(core[self.own], weight.t(), out=stage["y"])
        if self.flags:
            self.flags.wait(k, 0)
        else:
            caller.wait_stream(self.copy_stream)

    def _gather(self, k):
        stage = self.stages[k]
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            for target in stage["gathers"]:
                target.copy_(stage["h"][self.own])
            if self.flags:
                self.flags.signal(k, 1)
                self.gathered = lambda: self.flags.wait(k, 1)
            else:
                launch(stage["gathered"])
                event = self.copy_stream.record_event()
                self.gathered = lambda: torch.cuda.current_stream().wait_event(event)

    def __call__(self):
        self.gathered = None
        self.h0.copy_(rms_norm(self.x, self.model.layers[0].attn_norm,
                               self.model.cfg.eps).view(self.h0.shape))
        h = self.h0
        for k, stage in enumerate(self.stages):
            self._producer(k, self._consumer(k, h))
            launch(stage["reduce"])
            h = stage["h"]
            if self.communicate:
                self._gather(k)
        if self.gathered is not None:
            self.gathered()
        if self.flags:  # the copy stream's work joins the forward once, at its end
            torch.cuda.current_stream().wait_stream(self.copy_stream)
        return h
