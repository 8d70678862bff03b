"""The seed scheduler API: FusionConfig, FusionScheduler, and the graph types it runs.

    from infini_dist.fusion import FusionScheduler, FusionConfig
    from infini_dist.fusion.patterns import create_all_reduce_add_rms_norm_pattern

    scheduler = FusionScheduler(FusionConfig(min_tensor_size=4096))
    out = scheduler.dispatch(create_all_reduce_add_rms_norm_pattern(),
                             {"x": x, "residual": residual, "weight": weight})
    out["output"], out["residual_out"]
"""

from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.fusion.router import (FUSED, UNFUSED, FusionConfig, FusionScheduler, Route,
                                       choose_route)

__all__ = ["FusionConfig", "FusionScheduler", "Route", "choose_route", "FUSED", "UNFUSED",
           "OpNode", "SubGraph"]
