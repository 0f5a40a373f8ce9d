"""`unikern run | worker | serve | validate`: the command-line front door."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

import anyio

from unikern.errors import ConfigError, UnikernError
from unikern.frontends import logs

if TYPE_CHECKING:
    from unikern.frontends.http.params import ServerParams
    from unikern.spec import PipelineSpec


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pipeline", nargs="?", default="generate", help="a pipeline YAML file or built-in name (default: generate)")
    parser.add_argument("--model", help="override the model of every stage that has one (a directory or hub repo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.KEY=VALUE", help="override a stage parameter or a server setting, e.g. kv.memory_fraction=0.2 or server.max_waiting=2")
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error (logs go to stderr)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unikern", description="LLM inference on unified memory, as an async microkernel over MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate a completion and stream it to stdout")
    _common(run)
    run.add_argument("--prompt", required=True)
    run.add_argument("--max-tokens", type=int, default=128)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int)
    run.add_argument("--chat", action="store_true", help="send the prompt as one user message through the chat template")
    worker = sub.add_parser("worker", help="serve the NDJSON protocol on stdin/stdout")
    _common(worker)
    worker.add_argument("--drain-seconds", type=float, default=30.0, help="on SIGTERM/SIGINT, wait this long for requests in flight")
    serve = sub.add_parser("serve", help="serve the OpenAI and Anthropic HTTP APIs (settings: the file's server: section)")
    _common(serve)
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8000; 0 picks a free one)")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` or `x-api-key: KEY` on /v1/*")
    serve.add_argument("--drain-seconds", type=float, help="on SIGTERM/SIGINT, wait this long for requests in flight (default 30)")
    validate = sub.add_parser("validate", help="check a pipeline file; print every problem")
    validate.add_argument("pipeline")
    return parser


def _engine_factory(args: argparse.Namespace):
    from unikern.engine import Engine
    from unikern.spec import load_pipeline, parse_overrides

    spec = load_pipeline(args.pipeline, model=args.model, overrides=parse_overrides(args.overrides))
    return lambda: Engine(spec)


def _follow(args: argparse.Namespace) -> int:
    """Serve as a rank other than 0 (MLX_RANK=k): rank 0, the same command, sends the rest."""
    from unikern.spec import load_pipeline, parse_overrides
    from unikern.stages.execute.follower import main as follower_main

    spec = load_pipeline(args.pipeline, model=args.model, overrides=parse_overrides(args.overrides))
    execute = [s.params for s in spec.stages.values() if s.type == "mlx_execute"]
    if not execute or max(execute[0].get("tensor_parallel", 1), execute[0].get("pipeline_parallel", 1)) < 2:
        # rank 0, the same command, would serve alone and this rank wait for it forever
        raise ConfigError(
            f"MLX_RANK={os.environ['MLX_RANK']}: this command runs as a rank other than 0, but its pipeline asks "
            f"for one rank; set execute.tensor_parallel or execute.pipeline_parallel to the world's size"
        )
    backends = [p.get("distributed_backend", "auto") for p in execute]
    return follower_main(["--backend", backends[0] if backends else "auto", "--log-level", args.log_level])


def serve_settings(args: argparse.Namespace) -> tuple[PipelineSpec, ServerParams]:
    """`serve`'s pipeline and server settings: the file's `server:` section, then
    `--set server.KEY=VALUE`, then the flags (--host, --port, ...)."""
    from unikern.frontends.http.params import server_params
    from unikern.spec import load_pipeline, parse_overrides

    spec = load_pipeline(args.pipeline, model=args.model, overrides=parse_overrides(args.overrides))
    params = server_params(spec.server).with_overrides(
        host=args.host, port=args.port, api_key=args.api_key, drain_seconds=args.drain_seconds
    )
    return spec, params


def _serve(args: argparse.Namespace) -> int:
    from unikern.engine import Engine
    from unikern.frontends.http.server import HTTPServer

    spec, params = serve_settings(args)
    # the model as given (--model, or the file's), or `default`: what /v1/models reports
    given = next((stage.params["model"] for stage in spec.stages.values() if "model" in stage.params), "default")
    server = HTTPServer(
        lambda: Engine(spec), params, params.served_model_name or str(given),
        announce=lambda line: print(f"unikern: {line}", file=sys.stderr, flush=True),
    )
    return anyio.run(lambda: server.run(handle_signals=True), backend="asyncio")


async def _run(args: argparse.Namespace) -> int:
    from unikern.messages import DoneEvent, ErrorEvent, TokenEvent

    factory = _engine_factory(args)
    async with factory() as engine:
        request: dict[str, Any] = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        if args.chat:
            request["messages"] = [{"role": "user", "content": args.prompt}]
            events = engine.generate(**request)
        else:
            events = engine.generate(args.prompt, **request)
        out = sys.stdout
        async for event in events:
            if isinstance(event, TokenEvent):
                out.write(event.text)
                out.flush()
            elif isinstance(event, DoneEvent):
                out.write("\n")
                out.flush()
                u = event.usage
                print(
                    f"[{event.finish_reason}: {u.prompt_tokens} prompt tokens, "
                    f"{u.completion_tokens} generated, {u.cached_tokens} cached]",
                    file=sys.stderr,
                )
            elif isinstance(event, ErrorEvent):
                print(f"error: {event.message}", file=sys.stderr)
                return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(getattr(args, "log_level", "warning"))
    try:
        if args.command == "validate":
            from unikern.spec import load_pipeline

            load_pipeline(args.pipeline)
            print("ok")
            return 0
        if args.command in ("run", "worker", "serve") and os.environ.get("MLX_RANK", "0") != "0":
            return _follow(args)  # started by mlx.launch as a rank other than 0
        if args.command == "run":
            return anyio.run(_run, args)
        if args.command == "worker":
            from unikern.frontends.worker import run_worker

            factory = _engine_factory(args)
            return anyio.run(lambda: run_worker(factory, drain_seconds=args.drain_seconds))
        if args.command == "serve":
            return _serve(args)
    except ConfigError as exc:
        print(f"unikern: {exc}", file=sys.stderr if args.command != "validate" else sys.stdout)
        return 1 if args.command == "validate" else 2
    except UnikernError as exc:
        print(f"unikern: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def early_model_dir(argv: list[str]) -> str | None:
    """The model directory of `run`, `worker` or `serve` as its arguments give it
    (`--model DIR`, else `--set execute.model=DIR`), before the pipeline is read: what
    the read-ahead reads. None for another command or without a model argument."""
    if not argv or argv[0] not in ("run", "worker", "serve"):
        return None
    model = chosen = None
    for arg, value in zip(argv, [*argv[1:], ""], strict=True):
        if arg == "--model":
            model = value
        elif arg.startswith("--model="):
            model = arg.partition("=")[2]
        elif arg == "--set" and value.startswith("execute.model="):
            chosen = value.partition("=")[2]
    return model or chosen


def _read_ahead(argv: list[str]) -> None:
    """Start reading the model's weights while the rest imports (unikern.platform.read_ahead)."""
    model = early_model_dir(argv)
    if model is None or "MLX_RANK" in os.environ:  # a rank of several loads its shard only
        return
    from pathlib import Path

    from unikern.platform import read_ahead

    try:
        if read_ahead.wanted():
            read_ahead.start(Path(model).expanduser())
    except ConfigError as exc:
        print(f"unikern: {exc}", file=sys.stderr)
        leave(2)


def entry() -> None:
    """The `unikern` command and `python -m unikern`: the model's weights read on a
    thread (`_read_ahead`) while the tokenizer's stack imports without PyTorch
    (`unikern.platform.imports`; UNIKERN_IMPORT_TORCH=1 keeps transformers' own import
    of it), main(), then `leave`."""
    _read_ahead(sys.argv[1:])
    if os.environ.get("UNIKERN_IMPORT_TORCH", "0") != "1":
        from unikern.platform.imports import import_tokenizer_stack

        import_tokenizer_stack()
    leave(main())


def leave(code: int) -> None:
    """Flush stdout/stderr and end the process with os._exit.

    For a process whose own work is over (the engine's stages have stopped, every request
    has ended, results are written): the interpreter's teardown would only tear down
    MLX's and PyTorch's native state, which took ~2 s, and about one worker exit in 30
    after a SIGTERM that cancelled requests aborted inside it ("terminate called without
    an active exception", exit -6)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
