import os
import subprocess
import sys

import pytest

from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.boundary import (external_inputs, find_sites, live_outputs,
                                            prologue_chain)


def block_graph(eps=1e-6):
    """scale -> all_reduce -> add_rms_norm -> relu, with the residual sum also a graph output."""
    return SubGraph((OpNode("scale", ("x",), ("xs",), {"scale": 0.5}),
                     OpNode("all_reduce", ("xs",), ("y",)),
                     OpNode("add_rms_norm", ("y", "res", "w"), ("out", "res_out"), {"eps": eps}),
                     OpNode("relu", ("out",), ("act",))),
                    ("x", "res", "w"), ("act", "res_out"))


def test_nodes_are_frozen_hashable_and_compare_by_value():
    a = OpNode("scale", ("x",), ("y",), {"scale": 2.0})
    b = OpNode("scale", ["x"], ["y"], {"scale": 2.0})
    assert a == b and hash(a) == hash(b)
    assert a != OpNode("scale", ("x",), ("y",), {"scale": 3.0})
    with pytest.raises(Exception):
        a.op_type = "relu"
    assert block_graph() == block_graph() and hash(block_graph()) == hash(block_graph())
    assert block_graph(1e-6) != block_graph(1e-5)
    assert len({block_graph(), block_graph(), block_graph(1e-5)}) == 2


def test_construction_errors_are_clear():
    with pytest.raises(TypeError, match="bare string"):
        OpNode("relu", "x", ("y",))
    with pytest.raises(TypeError, match="bare string"):
        SubGraph((OpNode("relu", ("x",), ("y",)),), "x", ("y",))
    with pytest.raises(ValueError, match="unknown op 'frobnicate'"):
        SubGraph((OpNode("frobnicate", ("x",), ("y",)),), ("x",), ("y",))
    with pytest.raises(ValueError, match="reads 'z'"):
        SubGraph((OpNode("add", ("x", "z"), ("y",)),), ("x",), ("y",))
    with pytest.raises(ValueError, match="never produced"):
        SubGraph((OpNode("relu", ("x",), ("y",)),), ("x",), ("nope",))
    with pytest.raises(ValueError, match="defined twice"):
        SubGraph((OpNode("relu", ("x",), ("x",)),), ("x",), ("x",))
    with pytest.raises(ValueError, match="2 output"):
        SubGraph((OpNode("add_rms_norm", ("x", "r", "w"), ("y",)),), ("x", "r", "w"), ("y",))
    with pytest.raises(TypeError, match="attribute"):
        OpNode("scale", ("x",), ("y",), {"scale": object()})


def _key_in_subprocess():
    code = ("import torch; from tests.test_ir import block_graph; "
            "print(block_graph().cache_key([torch.bfloat16]*3, [(4, 8), (4, 8), (8,)], world=2))")
    env = dict(os.environ, PYTHONHASHSEED=str(os.getpid() % 1000 + 1))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_cache_key_is_stable_across_processes():
    import torch
    here = block_graph().cache_key([torch.bfloat16] * 3, [(4, 8), (4, 8), (8,)], world=2)
    assert len(here) == 64
    assert _key_in_subprocess() == here == _key_in_subprocess()
    # and it changes with everything it covers
    assert here != block_graph().cache_key([torch.float16] * 3, [(4, 8), (4, 8), (8,)], world=2)
    assert here != block_graph().cache_key([torch.bfloat16] * 3, [(2, 8), (2, 8), (8,)], world=2)
    assert here != block_graph().cache_key([torch.bfloat16] * 3, [(4, 8), (4, 8), (8,)], world=4)
    assert here != block_graph(1e-5).cache_key([torch.bfloat16] * 3, [(4, 8), (4, 8), (8,)],
                                               world=2)


def test_boundaries_of_a_collective():
    graph = block_graph()
    (site,) = find_sites(graph)
    assert site.anchors == (1,)
    assert site.prologue == (0,) and site.epilogue == (2, 3)
    assert (site.first, site.last) == (0, 3)
    assert live_outputs(graph, site.region) == ("res_out", "act")
    assert external_inputs(graph, site.region) == ("x", "res", "w")
    assert find_sites(graph, ("epilogue",))[0].prologue == ()
    assert find_sites(graph, ("prologue",))[0].epilogue == ()


def test_prologue_stops_at_values_with_other_users():
    graph = SubGraph((OpNode("relu", ("x",), ("a",)),
                      OpNode("scale", ("a",), ("b",), {"scale": 2.0}),
                      OpNode("all_reduce", ("b",), ("c",)),
                      OpNode("add", ("c", "a"), ("d",))), ("x",), ("d",))
    # `a` is also read by the add, so relu cannot move into the collective's prologue
    assert prologue_chain(graph, 2) == (1,)
    (site,) = find_sites(graph)
    assert site.epilogue == (3,)


def test_epilogue_stops_at_the_first_node_that_cannot_fuse():
    graph = SubGraph((OpNode("all_reduce", ("x",), ("y",)),
                      OpNode("relu", ("y",), ("a",)),
                      OpNode("relu", ("z",), ("zz",)),  # independent: ends the chain
                      OpNode("add", ("a", "zz"), ("out",))), ("x", "z"), ("out",))
    (site,) = find_sites(graph)
    assert site.epilogue == (1,)
    assert live_outputs(graph, site.region) == ("a",)


def test_adjacent_all_reduces_coalesce_only_with_cross_subgraph():
    graph = SubGraph((OpNode("all_reduce", ("g",), ("g2",)),
                      OpNode("all_reduce", ("u",), ("u2",)),
                      OpNode("swiglu", ("g2", "u2"), ("out",))), ("g", "u"), ("out",))
    (coalesced,) = find_sites(graph)
    assert coalesced.anchors == (0, 1) and coalesced.epilogue == (2,)
    first, second = find_sites(graph, ("epilogue", "prologue"))
    assert first.anchors == (0,) and first.epilogue == ()
    assert second.anchors == (1,) and second.epilogue == (2,)


def test_dependent_all_reduces_do_not_coalesce():
    graph = SubGraph((OpNode("all_reduce", ("x",), ("y",)),
                      OpNode("all_reduce", ("y",), ("z",))), ("x",), ("z",))
    assert [s.anchors for s in find_sites(graph)] == [(0,), (1,)]


def test_pickled_graph_rehashes_in_the_new_process():
    import pickle
    graph = block_graph()
    hash(graph)  # caches the hash on the instance
    copy = pickle.loads(pickle.dumps(graph))
    assert "_hash" not in copy.__dict__ and copy == graph and hash(copy) == hash(graph)
