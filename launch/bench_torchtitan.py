"""torchtitan as a client: its Llama3 and its own parallelize_llama (tensor parallel over every
rank, sequence parallel on and off), compiled as torchtitan compiles it (apply_compile: each
TransformerBlock through torch.compile; the loss too), trained with plain compile and with the
infini_dist pass turned on by a user's one line, `infini_dist.compile.enable()`.

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_torchtitan \\
        --out titan_out [--steps 50 --warmup 5 --seq 4096 --batch 1 --layers 2 --sp on,off]
    ... -m infini_dist.launch.bench_torchtitan --cpu-smoke --out DIR    (gloo, fp32, tiny)

Per SP setting and variant (inductor: plain compile; infini_dist: enable() first), a fresh
model with the first variant's initial weights trains --steps AdamW steps on the same random
token batches (no tokenizer, no download). With the pass, one step decides every site, then
torch._dynamo.reset() lets the blocks compile again, so that sites decided native become
Inductor's own code (README, "Once the sites have decided"); not with --cpu-smoke. Steps after
--warmup are timed (median per rank, max over ranks); --rounds N trains plain compile and the
pass N times each, in alternating order, and reports the median over rounds with their range
(a process's step time drifts by a few percent between runs of one variant). Compared with
plain compile: each step's loss and the last step's gradient of every parameter (relative norm
of the difference); exit status 1 past --tol. In bf16 a third run, torchtitan uncompiled
(eager), is compared the same way: the pass may differ from plain compile by twice as much as
eager does, if that is more than --tol (bf16 reduction order alone moves the gradients by ~1e-2
after a few steps). Results JSON and a table under --out; every graph the pass saw is listed
(forward or backward, its collectives, the sites it made).

torchtitan 0.3.0's path here imports only spmd_types and tyro (docstring_parser, typeguard).
Not its trainer module (it imports the data stack): set_llama3_sharding_config is what its
update_from_config calls for TP. Its default spmd_backend "spmd_types" fails in fully_shard on
torch 2.13 (no spmd_types annotations read there); "partial_dtensor" (DTensor TP) runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from infini_dist.launch import shutdown
from infini_dist.launch.arguments import names, nonnegative_int, parse, positive_float, positive_int

VARIANTS = ("inductor", "infini_dist")


@dataclass(frozen=True)
class Setup:
    dim: int = 4096
    layers: int = 2
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    vocab: int = 128256
    seq: int = 4096
    batch: int = 1
    sp: bool = True
    attn: str = "sdpa"  # torchtitan's "flex" has no CPU backward
    spmd_backend: str = "partial_dtensor"
    async_tp: bool = False
    dtype: str = "bfloat16"  # torchtitan's mixed_precision_param (FSDP2 at degree 1 casts)


CPU_SMOKE = dict(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, seq=16, batch=2,
                 dtype="float32")


def torch_compat() -> str | None:
    """torchtitan 0.3.0 imports `DataParallelMeshDims` from torch.distributed.fsdp at module level
    (torch >= 2.12); the GPU image's torch 2.11 lacks the name. It is read only under its
    full_dtensor / spmd_types backends (fully_shard(dp_mesh_dims=...)); the partial_dtensor path
    here passes None and never calls fully_shard with it. So on a torch without it the name is
    given a placeholder that refuses to be built, and nothing else of torchtitan's changes.
    Returns what was done (None: nothing), for results.json."""
    import torch.distributed.fsdp as fsdp
    if hasattr(fsdp, "DataParallelMeshDims"):
        return None

    class DataParallelMeshDims:  # noqa: D401 - a stand-in, never instantiated on this path
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"torch {torch.__version__} has no DataParallelMeshDims: "
                                      "torchtitan's full_dtensor backend needs torch >= 2.12")
    fsdp.DataParallelMeshDims = DataParallelMeshDims
    return f"torch {torch.__version__}: torch.distributed.fsdp.DataParallelMeshDims placeholder"


def llama3_config(setup: Setup):
    """torchtitan's Llama3 config at this size, its layers from its own builder."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    layers = _build_llama3_layers(
        n_layers=setup.layers, dim=setup.dim, n_heads=setup.heads, n_kv_heads=setup.kv_heads,
        hidden_dim=setup.ffn, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=setup.dim // setup.heads, max_seq_len=setup.seq,
                                theta=500000.0))
    if setup.attn == "sdpa":  # torchtitan's SDPA module (causal; Flux builds it the same way)
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=setup.dim, vocab_size=setup.vocab, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=setup.vocab, embedding_dim=setup.dim),
        norm=RMSNorm.Config(normalized_shape=setup.dim),
        lm_head=Linear.Config(in_features=setup.dim, out_features=setup.vocab))
    set_llama3_sharding_config(config, enable_sp=setup.sp)
    return config


def parallel_dims(setup: Setup, device: torch.device):
    """torchtitan's ParallelDims: TP over every rank of the job, its meshes built."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import utils as titan_utils
    parallelism = ParallelismConfig(tensor_parallel_degree=dist.get_world_size(),
                                    enable_sequence_parallel=setup.sp,
                                    spmd_backend=setup.spmd_backend)
    titan_utils.set_spmd_backend(setup.spmd_backend)  # what its trainer does first
    # torchtitan picks its mesh device at import ("cuda" when no accelerator is found)
    titan_dims.device_type = device.type
    dims = titan_dims.ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    return dims, parallelism


def compile_config_of(setup: Setup, compiled: bool):
    """torchtitan's CompileConfig for a variant. Its async TP is a compile pass, which its
    parallelize refuses without compile: the eager reference runs plain TP."""
    from torchtitan.config import CompileConfig
    return CompileConfig(enable=compiled, enable_async_tensor_parallel=setup.async_tp and compiled)


def build(setup: Setup, device: torch.device, out: str, compiled: bool = True):
    """(model, loss_fn) as torchtitan's trainer builds them: meta init,
    parallelize_llama (TP, then its apply_compile unless not `compiled`, then FSDP2 at degree
    1), materialized."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama
    dims, parallelism = parallel_dims(setup, device)
    compile_config = compile_config_of(setup, compiled)
    with torch.device("meta"):
        model = llama3_config(setup).build()
    model = parallelize_llama(model, parallel_dims=dims, parallelism=parallelism,
                              training=TrainingConfig(mixed_precision_param=setup.dtype),
                              compile_config=compile_config, ac_config=None, dump_folder=out)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=setup.vocab),
                               compile_config=compile_config)
    return model, loss_fn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def batches(setup: Setup, steps: int, device):
    """(inputs, labels, kwargs) per step: the same random tokens on every rank and variant."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, setup.vocab, (setup.batch, setup.seq + 1), generator=gen).to(device)
        yield ids[:, :-1], ids[:, 1:]


def forward_kwargs(model, setup: Setup, device) -> dict:
    """What torchtitan's trainer passes beside the tokens: FlexAttention's block-causal masks
    from the positions (one document per row); SDPA is causal by itself."""
    if setup.attn != "flex":
        return {}
    positions = torch.arange(setup.seq, device=device).expand(setup.batch, setup.seq)
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions)}


@contextlib.contextmanager
def graph_sites():
    """Every graph the pass runs on while open, as the results list it: forward or backward,
    its collectives before the pass, and the sites it made (op types joined by "+"). The list
    fills when the block ends."""
    import infini_dist.compile as idc
    rows: list[dict] = []
    with idc.recording() as graphs:
        yield rows
    rows += [{"kind": g.kind, "collectives": list(g.collectives),
              "sites": ["+".join(ops) for ops in g.site_ops()]} for g in graphs]


def train(variant: str, setup: Setup, args, device, control, initial: dict | None) -> dict:
    import infini_dist.compile as idc
    torch._dynamo.reset()
    if variant == "infini_dist":
        idc.enable()  # the user's one line, before torchtitan's compiled blocks first run
    model, loss_fn = build(setup, device, args.out, compiled=variant != "eager")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in (initial or {}).items():
            _local(params[name]).copy_(value)
    start_weights = {n: _local(p).detach().clone() for n, p in params.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tokens = torch.tensor(float(setup.batch * setup.seq), device=device)
    kwargs = forward_kwargs(model, setup, device)
    known = {d["subgraph"] for d in idc.decisions()}  # an earlier SP setting's sites
    losses, times, graphs, grads = [], [], [], {}
    for step, (inputs, labels) in enumerate(batches(setup, args.steps, device)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        with graph_sites() if step == 0 else contextlib.nullcontext([]) as seen:
            loss, _ = loss_fn(model(inputs, **kwargs), labels, tokens)
            loss.backward()
        graphs += seen
        if step == args.steps - 1:
            grads = {n: _local(p.grad).detach().float().cpu() for n, p in params.items()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # syncs the device
        if step >= args.warmup:
            times.append(time.perf_counter() - begin)
        if step == 0 and variant == "infini_dist" and not args.cpu_smoke:
            torch._dynamo.reset()  # decided: compile again, native sites as Inductor's code
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=control)
    ran = [d for d in idc.decisions() if d["subgraph"] not in known]
    idc.disable()
    return {"variant": variant, "sp": setup.sp, "losses": losses, "graphs": graphs,
            "step_ms": float(median) * 1e3, "tokens_per_s": setup.batch * setup.seq / float(median),
            "decided": sorted({(d["op"], d["choice"]) for d in ran}),
            "_grads": grads, "_initial": start_weights}


def compare(base: dict, ours: dict) -> dict:
    loss = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours["losses"], base["losses"]))
    grads = {n: float((g - base["_grads"][n]).norm() / base["_grads"][n].norm().clamp_min(1e-30))
             for n, g in ours["_grads"].items()}
    worst = max(grads, key=grads.get)
    return {"loss_rel_diff": loss, "grad_rel_diff": grads[worst], "worst_grad": worst,
            "grad_rel_diffs": grads,  # and a zero gradient would compare equal: show the least
            "min_grad_norm": min(float(g.norm()) for g in base["_grads"].values())}


def run(args, device, control, tol: float) -> list[dict]:
    """Per SP setting: plain compile, the pass, and in bf16 torchtitan uncompiled, each compared
    with plain compile (the grads kept rank-local). The pass's row gets the differences it is
    allowed: `tol`, or in bf16 twice what plain compile differs from eager, whichever is larger
    (eager vs plain is this run's bf16 reduction-order noise: a correct pass differs from plain
    compile by about as much; a lost term differs by O(1))."""
    rows = []
    for sp in args.sp:
        setup = Setup(**{**asdict(args.setup), "sp": sp == "on"})
        base = train("inductor", setup, args, device, control, None)
        ours = train("infini_dist", setup, args, device, control, base["_initial"])
        ours["vs_inductor"] = compare(base, ours)
        rounds = {"inductor": [base["step_ms"]], "infini_dist": [ours["step_ms"]]}
        for number in range(1, args.rounds):  # the pair again, its order alternating
            order = ("infini_dist", "inductor") if number % 2 else ("inductor", "infini_dist")
            for variant in order:
                again = train(variant, setup, args, device, control, base["_initial"])
                rounds[variant].append(again["step_ms"])
        for row in (base, ours):
            row["rounds_ms"] = rounds[row["variant"]]
            row["step_ms"] = statistics.median(row["rounds_ms"])
            row["tokens_per_s"] = setup.batch * setup.seq / (row["step_ms"] / 1e3)
        ours["speed"] = verdict(base["rounds_ms"], ours["rounds_ms"])
        rows += [base, ours]
        noise = None
        if setup.dtype != "float32":
            eager = train("eager", setup, args, device, control, base["_initial"])
            noise = eager["vs_inductor"] = compare(base, eager)
            rows.append(eager)
        ours["allowed"] = allowed(tol, noise)
    return rows


def verdict(plain_ms: list[float], ours_ms: list[float]) -> str:
    """The pass against plain compile over rounds of both: apart only where every round of one
    is faster than every round of the other (a round's median moves between rounds)."""
    if max(ours_ms) < min(plain_ms):
        return "faster in every round"
    if min(ours_ms) > max(plain_ms):
        return "slower in every round"
    return "within the rounds' spread"


def allowed(tol: float, noise: dict | None) -> dict:
    """The differences from plain compile a pass row may have: `tol`, or twice eager's (`noise`,
    its comparison with plain compile) where that is larger."""
    if noise is None:
        return {"loss": tol, "grad": tol}
    return {"loss": max(tol, 2 * noise["loss_rel_diff"]),
            "grad": max(tol, 2 * noise["grad_rel_diff"])}


def passes_check(row: dict) -> bool:
    """A pass row's differences from plain compile within what it is allowed."""
    v, allowed = row["vs_inductor"], row["allowed"]
    return v["loss_rel_diff"] <= allowed["loss"] and v["grad_rel_diff"] <= allowed["grad"]


def table(rows: list[dict]) -> str:
    lines = ["| SP | variant | step ms | rounds, ms | tokens/s | final loss | loss rel diff |"
             " grad rel diff | forward sites | backward sites |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v = r.get("vs_inductor", {})
        sites = [", ".join(sorted({s for g in r["graphs"] if g["kind"] == k
                                   for s in g["sites"]})) or "-" for k in ("forward", "backward")]
        spread = r.get("rounds_ms", [r["step_ms"]])
        spread = (f"{min(spread):.2f}–{max(spread):.2f} ({len(spread)})"
                  + (f", {r['speed']}" if "speed" in r else ""))
        lines.append(f"| {'on' if r['sp'] else 'off'} | {r['variant']} | {r['step_ms']:.2f} | "
                     f"{spread} | {r['tokens_per_s']:.0f} | {r['losses'][-1]:.5f} | "
                     f"{v.get('loss_rel_diff', 0):.2e} | {v.get('grad_rel_diff', 0):.2e} | "
                     f"{sites[0]} | {sites[1]} |")
    return "\n".join(lines)


def add_arguments(parser):
    parser.add_argument("--out", default="bench_torchtitan_out")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="gloo CPU ranks, fp32, a tiny model, no recompile after deciding")
    parser.add_argument("--sp", type=names(("on", "off")), default="on,off",
                        help="torchtitan's enable_sequence_parallel, each setting in turn")
    parser.add_argument("--async-tp", action="store_true",
                        help="torchtitan's enable_async_tensor_parallel (CUDA symmetric memory)")
    parser.add_argument("--attn", choices=("sdpa", "flex"), default="sdpa")
    parser.add_argument("--steps", type=positive_int, default=50)
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="plain compile and the pass trained this many times each, their "
                             "order alternating; step ms is the median over rounds")
    parser.add_argument("--warmup", type=nonnegative_int, default=5, help="untimed first steps")
    parser.add_argument("--lr", type=positive_float, default=1e-4)
    parser.add_argument("--tol", type=positive_float, default=None,
                        help="max loss and grad relative difference from plain compile (default "
                             "2e-2 bf16, 1e-4 fp32); in bf16 at least twice eager's")
    for flag in ("dim", "layers", "heads", "kv-heads", "ffn", "vocab", "seq", "batch"):
        parser.add_argument(f"--{flag}", type=positive_int, default=None)


def finish(parser, args, world):
    if args.steps <= args.warmup:
        parser.error("--steps must be greater than --warmup")
    sizes = {f: getattr(args, f) for f in ("dim", "layers", "heads", "kv_heads", "ffn", "vocab",
                                          "seq", "batch") if getattr(args, f) is not None}
    args.setup = Setup(**{**(CPU_SMOKE if args.cpu_smoke else {}), **sizes, "attn": args.attn,
                          "async_tp": args.async_tp})
    s = args.setup
    if s.dim % s.heads or s.heads % world or s.kv_heads % world or s.heads % s.kv_heads:
        parser.error(f"heads {s.heads} and kv-heads {s.kv_heads} must split over {world} ranks "
                     f"and heads must divide dim {s.dim}")
    if "on" in args.sp and s.seq % world:
        parser.error(f"sequence parallel splits --seq {s.seq} over {world} ranks")


def parse_args(argv=None) -> argparse.Namespace:
    return parse(argv, add_arguments, finish, prog="bench_torchtitan", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv=None) -> int:
    args = parse_args(argv)
    from infini_dist.launch.job import setup as join_job
    device, _, control = join_job(args)  # gloo for --cpu-smoke; the FX caches off (sites seen)
    tol = args.tol or (1e-4 if args.setup.dtype == "float32" else 2e-2)
    compat = torch_compat()  # before torchtitan's first import
    rows = run(args, device, control, tol)
    ok = all(passes_check(r) for r in rows if r["variant"] == "infini_dist")
    if dist.get_rank() == 0:
        text = table(rows)
        print(text, flush=True)
        os.makedirs(args.out, exist_ok=True)
        meta = {"world_size": dist.get_world_size(), "setup": asdict(args.setup), "tol": tol,
                "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "ok": ok,
                "torch": torch.__version__, "torch_compat": compat,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": public}, f, indent=1)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text + "\n")
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
