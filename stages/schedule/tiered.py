"""schedule_tiered: the step loop of `schedule`, plus the schedule side of tiering: a request
whose prefix continues on disk is held until the offload mover has loaded those blocks into
the pool, and blocks committed by a step are sent to be stored."""

from __future__ import annotations

from typing import Any

from unikern import messages as m
from unikern.stage import StageContext
from unikern.stages.schedule.stage import ScheduleStage
from unikern.stages.schedule.tier_planner import TierPlanner


class TieredScheduleStage(ScheduleStage):
    """The policy is `TierPlanner`; this stage only moves its messages."""

    consumes = (*ScheduleStage.consumes, m.BlocksLoaded, m.BlocksStored)
    produces = (*ScheduleStage.produces, m.LoadBlocks, m.StoreBlocks)
    requires = (*ScheduleStage.requires, "disk")

    def setup(self, ctx: StageContext) -> None:
        disk = ctx.resource("disk")
        self.planner = TierPlanner(self.scheduler.blocks, disk.contains, ctx.resource("kv").window_blocks)

    async def on_tokenized(self, ctx: StageContext, request: m.Tokenized) -> bool:
        if not await super().on_tokenized(ctx, request):
            return False
        hold, load = self.planner.plan_load(request)
        if hold:
            self.scheduler.hold(request.request_id)
        if load is not None:
            await ctx.send(load)
        return True

    async def handle(self, ctx: StageContext, message: Any) -> m.StepOutput | None:
        output = None
        match message:
            case m.BlocksLoaded():
                for request_id, pins in self.planner.loaded(message):
                    if not self.scheduler.release(request_id, pins):
                        self.scheduler.blocks.free(pins)
            case m.BlocksStored():
                self.planner.stored(message)
            case m.Abort(request_id=rid):
                self.planner.cancel(rid)
                output = await super().handle(ctx, message)
            case _:
                output = await super().handle(ctx, message)
        store = self.planner.plan_store()
        if store is not None:
            await ctx.send(store)
        return output

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        planner = getattr(self, "planner", None)
        if planner is not None:
            s = planner.stats
            stats["offload"] = {
                "held_requests": len(planner.staged),
                "loads_requested": s.loads_requested,
                "loads_done": s.loads_done,
                "load_failures": s.load_failures,
                "stores_requested": s.stores_requested,
            }
        return stats
