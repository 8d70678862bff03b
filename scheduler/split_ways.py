"""The ways a row-split chain's site can run (scheduler/split_chain.py), each a choice that
lockstep.worst_medians times: site by site, or split with every reader in row parts, the first
alone (`_first`), and either with each part's GEMMs in two column parts (`_cols`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infini_dist.scheduler.split_chain import ChainRunner, ChainSite

SITES, SPLIT = "sites", "split"


def way_names(spec: ChainSite) -> list[str]:
    """The split's ways at a site: every reader in row parts; _first: the first alone (several
    readers); _cols: each part's GEMMs in two column parts (widths that stay 16-byte
    aligned)."""
    names = [SPLIT] + ([f"{SPLIT}_first"] if len(spec.readers) > 1 else [])
    if spec.readers and all(n % 16 == 0 for n, _, _ in spec.readers):
        names += [f"{name}_cols" for name in names]
    return names


def way(name: str) -> tuple[int | None, int]:
    """A split way's (readers in row parts: None all, column parts) from its name:
    split[_first][_cols]."""
    return (1 if "_first" in name else None), (2 if name.endswith("_cols") else 1)


class Way:
    """One way of running a site for lockstep.time_choices: a name and run(values)."""

    def __init__(self, name: str, run):
        self.name, self._run = name, run

    def run(self, _values):
        return self._run()


class Ways:
    """Site `index` of a chain both ways, on random values of its sizes (never zeros)."""

    def __init__(self, runner: ChainRunner, index: int, device):
        spec, dtype = runner.sites[index], runner.dtype
        g = torch.Generator(device=device).manual_seed(1234 + index)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)
        w_shape = (spec.hidden, spec.k) if spec.transpose else (spec.k, spec.hidden)
        self.inputs = [rand(spec.rows, spec.k), rand(*w_shape, scale=spec.k ** -0.5),
                       rand(spec.rows, spec.hidden), 1 + rand(spec.hidden, scale=0.1)]
        self.readers = []
        for n, transpose, bias in spec.readers:
            self.readers.append(rand(*((n, spec.hidden) if transpose else (spec.hidden, n)),
                                     scale=spec.hidden ** -0.5))
            if bias:
                self.readers.append(rand(n, scale=0.1))
        self.runner, self.index = runner, index
        self.choices = [Way(SITES, lambda: self._both(SITES))]
        for name in way_names(spec):
            self.choices.append(Way(name, functools.partial(self._both, SPLIT, *way(name))))

    def _both(self, mode: str, parted: int | None = None, columns: int = 1) -> list:
        """The site and its readers `mode`'s way (split: the first `parted` readers in parts,
        each in `columns` column parts)."""
        runner = self.runner
        saved, runner.mode = runner.mode, mode
        if mode == SPLIT:
            runner.split[self.index].parted = parted
            runner.split[self.index].columns = columns
        try:
            h = runner.site(self.index, self.inputs)[0]
            outs = runner.read(self.index, [h] + self.readers)
            if mode == SPLIT:  # a capture must end joined; the chain joins once, at its end
                torch.cuda.current_stream().wait_stream(runner.copy_stream)
            return outs
        finally:
            runner.mode = saved

    def first_run(self) -> None:
        """Both ways once: the site's own tuning, the kernels' compiles."""
        for choice in self.choices:
            choice.run(None)
