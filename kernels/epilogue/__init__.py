"""The epilogue ops, one spec per module (`SPEC`, see `spec.OpSpec`). Adding an op is adding a
module here (and its test); the registry, the chain tables, the symmetric-memory op codes and
the compile pass's spellings are all derived from `SPECS`. Variants of one op that differ in
their operands (quant_fp8's scale as a number or as a tensor) share a module, as `SPECS`, so
their spellings stay in one matcher.

Modules are found by listing this package and ordered by name, so the derived op codes are the
same on every rank.
"""

from __future__ import annotations

import importlib
import pkgutil

from infini_dist.kernels.epilogue.spec import OpSpec


def _load() -> dict[str, OpSpec]:
    specs = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        loaded = importlib.import_module(f"{__name__}.{module}")
        own = getattr(loaded, "SPECS", None) or (getattr(loaded, "SPEC", None),)
        for spec in filter(None, own):
            if spec.name in specs:
                raise ValueError(f"two epilogue specs are named {spec.name!r}")
            specs[spec.name] = spec
    return dict(sorted(specs.items()))


SPECS: dict[str, OpSpec] = _load()
