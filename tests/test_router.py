"""The microkernel's start-up (kernel/router.py): members that require nothing of each
other set up at the same time, and a member that requires a resource starts only after
its provider has started."""

from types import SimpleNamespace

import anyio
import pytest

from unikern.errors import StageError
from unikern.router import Router
from unikern.stage import ServiceBase


def pipeline(classes: dict[str, type]) -> SimpleNamespace:
    return SimpleNamespace(name="test", stages={n: SimpleNamespace(params={}) for n in classes},
                           stage_classes=lambda: classes)


def services(log: list[str], peer_began: dict[str, anyio.Event]) -> dict[str, type]:
    """a and b each finish setting up only once the other has begun: one by one, the
    first would wait for ever. c requires a's resource."""

    def member(name: str, provides: tuple[str, ...] = (), requires: tuple[str, ...] = (), peer: str | None = None):
        class Member(ServiceBase):
            async def run(self, ctx, *, task_status) -> None:
                log.append(f"{name} begins")
                if name in peer_began:
                    peer_began[name].set()
                if peer is not None:
                    await peer_began[peer].wait()
                for key in requires:
                    assert ctx.resource(key) == key
                for key in provides:
                    ctx.provide(key, key)
                log.append(f"{name} started")
                task_status.started()
                await anyio.sleep_forever()

        Member.provides, Member.requires = provides, requires
        return Member

    return {"a": member("a", provides=("ra",), peer="b"), "b": member("b", provides=("rb",), peer="a"),
            "c": member("c", requires=("ra",))}


@pytest.mark.anyio
async def test_members_that_need_nothing_of_each_other_set_up_at_once():
    log: list[str] = []
    began = {"a": anyio.Event(), "b": anyio.Event()}
    send, receive = anyio.create_memory_object_stream(1)
    router = Router(pipeline(services(log, began)), send, lambda error: None)
    with send, receive, anyio.fail_after(10):  # one by one, a would wait for b for ever
        async with anyio.create_task_group() as tg:
            await tg.start(router.run)
            assert router.all_started.is_set()
            router.stop()
    assert log.index("c begins") > log.index("a started")
    assert {log[0], log[1]} == {"a begins", "b begins"}


@pytest.mark.anyio
async def test_a_failed_start_is_the_routers_error():
    class Broken(ServiceBase):
        async def run(self, ctx, *, task_status) -> None:
            await anyio.sleep(0.01)
            raise ValueError("no weights at /nowhere")

    class Slow(ServiceBase):
        async def run(self, ctx, *, task_status) -> None:
            await anyio.sleep_forever()

    send, receive = anyio.create_memory_object_stream(1)
    router = Router(pipeline({"slow": Slow, "broken": Broken}), send, lambda error: None)
    with send, receive, anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as raised:
        await router.run()
    error, = raised.value.exceptions  # one error, while slow still sets up
    assert isinstance(error, StageError) and "no weights at /nowhere" in str(error)
