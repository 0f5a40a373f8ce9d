"""schedule_tiered: the step loop of `schedule`, plus the schedule side of tiering: a request
whose prefix continues on disk is held until the offload mover has loaded those blocks (and,
for recurrent models, the state checkpoint at their end) into the pools, and blocks and
checkpoints committed by a step are sent to be stored."""

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
        self.planner = TierPlanner(
            self.scheduler.blocks, disk.contains, self.scheduler.states, disk.contains_state,
            ctx.resource("kv").window_blocks,
        )

    async def on_tokenized(self, ctx: StageContext, request: m.Tokenized) -> bool:
        if not await super().on_tokenized(ctx, request):
            return False
        if request.params.prompt_logprobs is not None:
            return True  # it reads no cached prefix (Scheduler._admit): nothing to load for it
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
                        self.planner.cancel(request_id)  # a checkpoint it held
            case m.BlocksStored():
                self.planner.stored(message)
            case m.Abort(request_id=rid):
                self.planner.cancel(rid)
                output = await super().handle(ctx, message)
            case m.StepDone():
                output = await super().handle(ctx, message)
                if self.scheduler.states is not None:
                    # commit the checkpoints this step reached now (planning the next step
                    # would), so they go to be stored before that step runs
                    self.scheduler.states.flush(self.scheduler.by_id)
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
                "state_loads_requested": s.state_loads_requested,
                "state_loads_done": s.state_loads_done,
                "state_load_failures": s.state_load_failures,
                "state_stores_requested": s.state_stores_requested,
            }
        return stats
