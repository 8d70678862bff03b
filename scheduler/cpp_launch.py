"""The committed launches the C++ table makes (kernels/express.py): an eager op's call, or a
compiled site's, that ran a committed symmetric-memory choice through its prepared short-path
launch is recorded, and the next call with the same op, group, scalar and input layouts is
matched and launched in C++ (`Entry.call`).

Everything else (tuning, native or NCCL choices, every-call agreement, autograd, other layouts)
keeps the Python path, and a call the C++ table does not match takes it too: the table only ever
skips host work whose outcome is already fixed. Callers never record: their executor offers the
launch after a Python-path call (engine.GraphExecutor.run).
"""

from __future__ import annotations

from infini_dist.kernels import express
from infini_dist.scheduler.choices import resolve_group


class Entry:
    """One caller's key into the C++ table: an eager op (the caller passes the group and a
    scalar) or a compiled site (`group_name`, resolved at each call). `call(op, group, scalar,
    tensors)`, with this entry's `op`, is the table's own C function (no Python frame on a hit),
    or None until the table is built; it returns None where no record matches."""

    def __init__(self, op: int, group_name: str | None = None):
        self.op = op
        self.group_name = group_name
        self.call = None
        self.executor = None  # the executor of this entry's latest Python-path call
        # (executor, group, scalar, layouts) offered since the table was last cleared, recorded
        # or not: an autograd call, which the table never takes, offers the same launch again.
        self._offered: set = set()
        self._offered_at = -1  # express.cleared() when _offered was last emptied

    def start(self, executor, inputs: dict) -> None:
        """At an op's first calls: begin building the table in the background, so that the
        build overlaps the first call's tuning (on a fresh machine, the calls until it is ready
        take the Python path)."""
        if _may_serve(executor, inputs):
            express.start()

    def offer(self, executor, inputs: dict, group, scalar: float) -> None:
        """Record the launch the call just made, where C++ can make it (`record`);
        a later call with the same op, group, scalar and layouts is then matched in C++."""
        if not _may_serve(executor, inputs):
            return
        if self.call is None:
            built = express.module()
            if built is None:
                return  # still building (`start`): calls take the Python path until ready
            self.call = built.call
        matched = resolve_group(self.group_name, None) if self.group_name is not None else group
        key = (id(executor), id(matched), scalar) + tuple(
            (t.shape, t.stride(), t.dtype, t.device) for t in inputs.values())
        if self._offered_at != express.cleared():
            self._offered.clear()
            self._offered_at = express.cleared()
        if key in self._offered:
            return
        self._offered.add(key)
        if record(self.op, executor, inputs, group, matched, scalar) is None:
            self._offered.discard(key)  # not yet: the launch has not taken its short path


def start_early(settings) -> None:
    """Where the table will serve (the flag on, CUDA here), begin building it now: called when
    the eager ops are imported, so that a job's setup (the process group, the model's load)
    hides a fresh machine's build (about 2 s: the module includes only Python.h) and the
    first calls find the table ready. The build is a background thread's, its cached result
    loads in a second, and a process that exits while it runs leaves no lock behind
    (express._build_lock)."""
    if settings.express_ops and express.cuda_here():
        express.start()


def _may_serve(executor, inputs: dict) -> bool:
    """Whether the C++ table may take calls like this one: the flag on, CUDA tensors."""
    return executor.settings.express_ops and any(t.is_cuda for t in inputs.values())


def record(op: int, executor, inputs: dict, group, matched, scalar: float) -> bool | None:
    """Whether the launch was recorded; None where a later call may record it."""
    runner = executor.single_site
    if runner is None:
        return False  # the launch would be only part of the call
    from infini_dist.scheduler.backends.symm_launch import PreparedLaunch  # CUDA only
    choice = runner.committed(inputs, group)
    prepared = choice.bound_runner() if choice is not None else None
    if not isinstance(prepared, PreparedLaunch):
        return False
    tensors = [inputs[name] for name in prepared.names]
    if not prepared.bound(tensors):
        return False  # this call copied its inputs (PreparedLaunch's normal path)
    if not prepared.launch.fast:  # it adopts its kernel at its first aligned call
        return False if prepared.launch.normal_only else None
    launch = express.launch_record(prepared.launch)
    if launch is None:
        return False
    written = prepared.plan.allocate(tensors[0].device, tensors[0])
    results = prepared.plan.results(written)
    made = list(written.values())
    outputs = executor.graph.output_names
    returned = [next(i for i, t in enumerate(made) if t is results[name]) for name in outputs]
    if len(set(returned)) != len(returned):
        return False  # one tensor for two outputs: the Python path's callers unalias them
    order = list(inputs)  # the op's tensors, in the order `call` passes them
    places = [order.index(n) for n in prepared.names] + [len(order) + i
                                                          for i in range(len(made))]
    launch["slots"] = [(cell, places[index]) for cell, index in launch["slots"]]
    used = {place for _, place in launch["slots"]}
    aligned = [i in used for i in range(len(order))]
    return express.add(op, matched, scalar, tensors[0].device.index, list(inputs.values()), made,
                       returned, launch, aligned, keep=prepared)
