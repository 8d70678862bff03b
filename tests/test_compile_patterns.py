"""One compile test per fusion pattern: every torch spelling of an IR op (fx_patterns.FORMS) in
every position the pass fuses it, and every site shape the pass builds (prologue, epilogue,
add + rms_norm folded into add_rms_norm, the norm's rsqrt exposed as rms_rstd, adjacent
all_reduces coalesced, chains on both sides).

Each case is a tiny function around a functional all_reduce, run on 2 gloo ranks: its
post-grad graph (tests/fx_graphs.py) before the pass (the anchors plus exactly the nodes of the
forms it spells), the pass's match count and the site's IR ops, the graph after (one
infini_dist.fused_site call, nothing left of the collective or the forms), and the rewritten
graph run through the engine against the eager function (fp32), bitwise equal across ranks.
Cases come from FORMS itself, so a new form is a new case.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import operator
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from infini_dist.compile import fx_patterns
from infini_dist.compile.fx_patterns import FORMS
from infini_dist.scheduler import op_registry
from infini_dist.kernels.epilogue.spec import EPS as SENTINEL_EPS
from infini_dist.kernels.epilogue.spec import SCALE as SENTINEL_SCALE
from fx_graphs import FUSED, ar, c10d, export, fuse, ops_of, rand
from multirank import run_ranks

SHAPE = (2, 3, 16)
FAST_TUNING = {"INFINI_DIST_BENCHMARK_REPS": "2", "INFINI_DIST_BENCHMARK_WARMUP": "1"}


@dataclass(frozen=True)
class Case:
    fn: Callable          # fn(reduce, *inputs): `reduce` is the functional all_reduce
    arity: int
    ops: tuple            # the site's IR ops, in order
    forms: tuple          # names of the FORMS the graph spells (their nodes are counted)
    anchors: int = 1
    weights: tuple = ()   # inputs that are a norm's weight (one row)
    per_rank: tuple = (0,)  # inputs that differ across ranks (all others are the same)
    attrs: tuple = ()     # (op index, {attr: value}) the site must carry
    scalars: tuple = ()   # inputs that are one-element tensors (a per-tensor FP8 scale)


def _form(name):
    return next(f for f in FORMS if f.name == name)


def _attrs(form) -> dict:
    """The IR attributes a match of `form` carries: fixed ones and captured sentinels (as the
    spelling's attrs_of turns them into the op's)."""
    captured = {name: value for name, value in form.captures}
    if form.attrs_of is not None:
        captured = form.attrs_of(captured)
    return {**dict(form.attrs), **captured}


def _weights(form, offset=0) -> tuple:
    return tuple(offset + v for v in form.vectors)  # a norm's weight and bias: one row each


def _epilogue(form, position):
    """form(..., reduced at `position`, ...)."""
    def fn(reduce, *inputs):
        args = list(inputs)
        args[position] = reduce(args[position])
        return form.fn(*args)
    return Case(fn, form.arity, ("all_reduce", form.op_type), (form.name,),
                weights=_weights(form), per_rank=(position,), attrs=((1, _attrs(form)),),
                scalars=form.scalars)


def _prologue(form):
    def fn(reduce, *inputs):
        return reduce(form.fn(*inputs))
    return Case(fn, form.arity, (form.op_type, "all_reduce"), (form.name,),
                weights=_weights(form), per_rank=tuple(range(form.arity)),
                attrs=((0, _attrs(form)),))


def _add_rms_norm(norm):
    def fn(reduce, x, residual, weight):
        h = reduce(x) + residual
        return norm.fn(h, weight), h
    return Case(fn, 3, ("all_reduce", "add_rms_norm"), ("add", norm.name), weights=(2,),
                attrs=((1, _attrs(norm)),))


def _rms_rstd():
    """A training forward graph keeps the norm's rsqrt for backward."""
    eps = SENTINEL_EPS

    def fn(reduce, x, residual, weight):
        h = reduce(x) + residual
        h32 = h.float()
        rstd = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * (h32 * rstd).to(h.dtype), h, rstd
    return Case(fn, 3, ("all_reduce", "add_rms_norm", "rms_rstd"), ("add", "rms_norm_llama"),
                weights=(2,), attrs=((1, {"eps": eps}), (2, {"eps": eps})))


def _coalesced():
    def fn(reduce, x, y):
        a, b = reduce(x), reduce(y)
        return torch.relu(a) + b
    return Case(fn, 2, ("all_reduce", "all_reduce", "relu", "add"), ("relu", "add"), anchors=2,
                per_rank=(0, 1))


def _chains():
    scale = SENTINEL_SCALE

    def fn(reduce, x):
        return torch.relu(reduce(torch.relu(x) * scale)) * scale
    return Case(fn, 1, ("relu", "scale", "all_reduce", "relu", "scale"),
                ("relu", "scale", "relu", "scale"), attrs=((1, {"scale": scale}),
                                                           (4, {"scale": scale})))


def cases() -> dict:
    found = {}
    for form in FORMS:
        for position in form.chain_inputs:
            found[f"epilogue-{form.name}-{position}"] = _epilogue(form, position)
        if op_registry.may_fuse(form.op_type, "prologue"):
            found[f"prologue-{form.name}"] = _prologue(form)
        if form.op_type == "rms_norm":
            found[f"add_rms_norm-{form.name}"] = _add_rms_norm(form)
    found.update({"rms_rstd": _rms_rstd(), "coalesced": _coalesced(), "chains": _chains()})
    return found


def inputs_of(case: Case, rank: int) -> list:
    def one(i):
        if i in case.scalars:  # a scale: positive, never zero
            return 0.05 + rand(1, seed=i).abs().reshape(())
        return rand(*(SHAPE[-1:] if i in case.weights else SHAPE),
                    seed=100 * (rank if i in case.per_rank else 0) + i)
    return [one(i) for i in range(case.arity)]


def _targets(gm) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def patterns_rank(rank, world):
    """Every case: exported and fused first (no site decided yet, so no graph sees a
    decision), then each rewritten graph run through the engine beside the eager function."""
    import torch.distributed as dist

    import infini_dist.compile as idc
    reduce = functools.partial(ar, group=dist.group.WORLD.group_name)
    results, graphs = {}, {}
    for name, case in cases().items():
        fn = functools.partial(case.fn, reduce)
        inputs = inputs_of(case, rank)
        try:
            gm = export(fn, *inputs)
            before = _targets(gm)
            replaced = idc.stats["sites"]
            subs = fuse(gm)
            results[name] = {
                "before": before, "after": _targets(gm), "reported": idc.stats["sites"] - replaced,
                "sites": [(ops_of(s), [n.attr_dict for n in s.nodes]) for s in subs]}
            graphs[name] = (gm, fn, inputs)
        except Exception as error:  # noqa: BLE001 - one broken case must not hide the others
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    for name, (gm, fn, inputs) in graphs.items():
        try:
            got, want = gm(*inputs), fn(*inputs)
            want = want if isinstance(want, tuple) else (want,)
            results[name]["diff"] = max(float((g.double() - w.double()).abs().max())
                                        for g, w in zip(got, want))
            results[name]["count"] = (len(got), len(want))
            results[name]["digest"] = _digest(got)
        except Exception as error:  # noqa: BLE001
            results[name]["error"] = f"{type(error).__name__}: {error}"
    return results


@pytest.fixture(scope="module")
def compiled():
    return run_ranks(patterns_rank, 2, env=FAST_TUNING, timeout=600)


def _nodes(form_name: str) -> int:
    """Graph nodes of one match of the form: its traced template's size."""
    templates = fx_patterns.templates(torch.float32, len(SHAPE), "cpu")
    return next(t.size for t in templates if t.form.name == form_name)


@pytest.mark.parametrize("name", sorted(cases()))
def test_pattern_compiles_to_one_site(compiled, name):
    case = cases()[name]
    for rank in compiled:
        r = rank[name]
        assert "error" not in r, r.get("error")
        before, after = r["before"], r["after"]
        # Before: the anchors and the forms' own nodes, nothing else.
        anchor = str(c10d.all_reduce.default)
        assert before[anchor] == case.anchors and before[str(c10d.wait_tensor.default)] == \
            case.anchors
        assert sum(before.values()) == 2 * case.anchors + sum(map(_nodes, case.forms)), before
        # The pass: one match, the site as the case spells it.
        assert r["reported"] == 1 and len(r["sites"]) == 1
        ((ops, attrs),) = r["sites"]
        assert ops == list(case.ops)
        for index, wanted in case.attrs:
            assert set(attrs[index]) == set(wanted), (index, attrs)
            for attr, value in wanted.items():  # strings (gelu's approximate) exactly
                close = value if isinstance(value, str) else pytest.approx(value, rel=1e-6)
                assert attrs[index][attr] == close, (index, attr, attrs)
        # After: one fused call, its outputs read through getitem; nothing else is left.
        assert after[str(FUSED)] == 1
        assert set(after) <= {str(FUSED), str(operator.getitem)}, after
        # The engine's result is eager's, the same bits on every rank.
        assert r["count"][0] == r["count"][1] and r["diff"] < 1e-5, r["diff"]
    assert compiled[0][name]["digest"] == compiled[1][name]["digest"]


def test_every_form_is_matched_in_some_case(compiled):
    """Every FORM appears in a case whose site holds its IR op (a form no case exercises, or
    one the pass no longer matches, fails here)."""
    all_cases = cases()
    for form in FORMS:
        hits = [name for name, case in all_cases.items() if form.name in case.forms
                and "error" not in compiled[0][name]
                and form.op_type in compiled[0][name]["sites"][0][0]]
        assert hits, form.name


# ---- graph only: the norm spellings in other dtypes ---------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [f for f in FORMS if f.op_type == "rms_norm"],
                         ids=lambda f: f.name)
def test_residual_add_and_each_rms_norm_form_become_add_rms_norm(norm, dtype):
    def f(x, residual, w):
        h = ar(x) + residual
        return norm.fn(h, w), h
    gm = export(f, rand(*SHAPE, dtype=dtype), rand(*SHAPE, dtype=dtype, seed=1),
                rand(SHAPE[-1], dtype=dtype, seed=2))
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce", "add_rms_norm"]
    anchor, fused = sub.nodes
    assert anchor.attr_dict == {"op": "sum", "group_name": "g0"}
    assert fused.inputs[0] == anchor.outputs[0]  # the reduced value is x, the residual 2nd
    assert fused.attr("eps") == pytest.approx(SENTINEL_EPS, rel=1e-6)
    assert sub.output_names == fused.outputs  # normed and the residual sum, both read later
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [FUSED, operator.getitem, operator.getitem]
