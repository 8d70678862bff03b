"""Which eager op calls, and which calls of the compile pass's sites (compile/runtime_op.py),
the C++ path (kernels/express.py) may make, and their records.

After a call took the Python path, `offer` looks at what it ran: where the op's one site ran a
committed symmetric-memory choice through its prepared short-path launch, with these exact
inputs, the launch is recorded, and the next call with the same op, group, scalar and input
layouts is matched and launched in C++ (`call`). Everything else (tuning, native or NCCL
choices, every-call agreement, autograd, other layouts) keeps the Python path, and a call the
C++ table does not match takes it too: the table only ever skips host work whose outcome is
already fixed.
"""

from __future__ import annotations

import infini_dist
from infini_dist.kernels import express
from infini_dist.scheduler.backends.symm_launch import PreparedLaunch
from infini_dist.scheduler.choices import resolve_group

OPS = {"all_reduce_relu_scale": 0, "all_reduce_add_rms_norm": 1, "all_reduce_swiglu": 2}
_SITES: dict[str, tuple[int, str | None]] = {}  # compiled site text -> (op id, group name)
# (executor, op, group, scalar, layouts) offered since the table was last cleared, recorded or
# not: an autograd call, which the table never takes, offers the same launch again every time.
_offered: set = set()
_offered_at = [-1]  # express.cleared() when _offered was last emptied
call = None  # the C++ table's call(op, group, scalar, tensors) once built, else None


def site(text: str) -> tuple[int, str | None] | None:
    """(op id, group name) of a compiled site (compile/runtime_op.py) offered before."""
    return _SITES.get(text)


def offer(op: int | str, executor, inputs: dict, outputs: tuple, group, scalar: float,
          site_text: str | None = None) -> None:
    """Record the launch the call just made, where it can be made from C++ (see module).
    `op`: an eager op's name, or None with `site_text` (a compiled site's graph, whose group
    the graph names: records match the group it resolves to at each call)."""
    global call
    if not infini_dist.config.express_ops or not any(t.is_cuda for t in inputs.values()):
        return
    built = express.module()
    if built is None:
        express.start()  # in the background; calls take the Python path until it is ready
        return
    call = built.call
    matched = group
    if site_text is not None:
        site = executor.single_site
        name = site.group_name if site is not None else None
        op, _ = _SITES.setdefault(site_text, (1000 + len(_SITES), name))
        matched = resolve_group(name, None)
    else:
        op = OPS[op]
    key = (id(executor), op, id(matched), scalar) + tuple(
        (t.shape, t.stride(), t.dtype, t.device) for t in inputs.values())
    if _offered_at[0] != express.cleared():
        _offered.clear()
        _offered_at[0] = express.cleared()
    if key in _offered:
        return
    _offered.add(key)
    if _record(op, executor, inputs, outputs, group, matched, scalar) is None:
        _offered.discard(key)  # not yet: the launch has not taken its short path


def _record(op: int, executor, inputs: dict, outputs: tuple, group, matched,
            scalar: float) -> bool | None:
    """Whether the launch was recorded; None where a later call may record it."""
    runner = executor.single_site
    if runner is None:
        return False  # the launch would be only part of the call
    choice = runner.committed(inputs, group)
    direct = choice._runner if choice is not None and choice._direct else None
    prepared = getattr(direct, "prepared", None)
    if not isinstance(prepared, PreparedLaunch):
        return False
    tensors = [inputs[name] for name in prepared.names]
    if not prepared.bound(tensors):
        return False  # this call copied its inputs (PreparedLaunch's normal path)
    if not prepared.launch.fast:  # it adopts its kernel at its first aligned call
        return False if prepared.launch.normal_only else None
    record = express.launch_record(prepared.launch)
    if record is None:
        return False
    written = prepared.plan.allocate(tensors[0].device, tensors[0])
    results = prepared.plan.results(written)
    made = list(written.values())
    returned = [next(i for i, t in enumerate(made) if t is results[name]) for name in outputs]
    if len(set(returned)) != len(returned):
        return False  # one tensor for two outputs: the Python path's callers unalias them
    order = list(inputs)  # the op's tensors, in the order `call` passes them
    places = [order.index(n) for n in prepared.names] + [len(order) + i
                                                          for i in range(len(made))]
    record["slots"] = [(cell, places[index]) for cell, index in record["slots"]]
    used = {place for _, place in record["slots"]}
    aligned = [i in used for i in range(len(order))]
    return express.add(op, matched, scalar, tensors[0].device.index, list(inputs.values()), made,
                       returned, record, aligned, keep=prepared)
