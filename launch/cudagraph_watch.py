"""Did torch.compile's cudagraph trees really replay? Counts the skips torch reports per call.

mode="reduce-overhead" falls back to running the compiled code without CUDA graphs, silently
apart from one log line, when a graph mutates an input that is not a static address, reads a
CPU tensor, and more. A bench that times such a variant measures launch overhead, not replays.
Torch bumps counters["inductor"]["cudagraph_skips"] for every skip (at compile time or at the
first run of a graph) and logs the reason on the "cudagraphs" artifact logger.
"""

from __future__ import annotations

import logging


class CudagraphWatch(logging.Handler):
    """Wrap every call of one compiled variant in `call`; `skips` and `reasons` say what torch
    reported during those calls. Attach the handler (`with watch:`) around the calls."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.skips, self.reasons, self.replayed = 0, [], None
        self._messages: list[str] = []

    def emit(self, record):
        self._messages.append(record.getMessage().replace("\n", " ")[:300])

    def __enter__(self):
        from torch._inductor.cudagraph_utils import cudagraphs_log
        cudagraphs_log.addHandler(self)
        return self

    def __exit__(self, *exc):
        from torch._inductor.cudagraph_utils import cudagraphs_log
        cudagraphs_log.removeHandler(self)

    def call(self, fn, device=None):
        """fn(); on a CUDA `device`, also notes whether that call ran as a recorded graph."""
        from torch._dynamo.utils import counters
        skips, seen = counters["inductor"]["cudagraph_skips"], len(self._messages)
        try:
            return fn()
        finally:
            self.skips += counters["inductor"]["cudagraph_skips"] - skips
            self.reasons += [m for m in self._messages[seen:] if m not in self.reasons]
            if device is not None and device.type == "cuda":
                self.replayed = ran_as_graph(device)

    def report(self) -> dict:
        """The fields of a result row: cudagraphs true only when nothing was skipped and (where
        it could be seen) the last call ran a recorded graph."""
        row = {"cudagraphs": self.skips == 0 and self.replayed is not False}
        if self.skips:
            row["cudagraph_skips"] = self.skips
            row["cudagraph_skip_reasons"] = self.reasons or ["(no reason logged: non-CUDA graph)"]
        if self.replayed is False and not self.skips:
            row["cudagraph_skip_reasons"] = ["last timed call did not run a recorded graph"]
        return row


def ran_as_graph(device) -> bool | None:
    """Whether the cudagraph tree of `device` last ran a recorded graph (not a warm-up node or
    no tree at all); None where this torch's private layout is not the one expected."""
    try:
        from torch._inductor import cudagraph_trees
        manager = cudagraph_trees.get_manager(device.index, create_if_none_exists=False)
        node = getattr(manager, "current_node", None)
        return isinstance(node, cudagraph_trees.CUDAGraphNode)
    except (ImportError, AttributeError, TypeError):
        return None
