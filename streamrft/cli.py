"""The `streamrft` command: one thin entry point per process kind.

Configs are parsed and validated before heavy imports (torch, transformers) happen.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import select
import signal
import sys
import threading


def _train(args: argparse.Namespace) -> int:
    if args.dry_run:
        return _train_or_check(args)
    previous = _stop_on_signals_during_startup()
    try:
        return _train_or_check(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_on_signals_during_startup() -> dict:
    """Until the run's loop takes Ctrl-C and SIGTERM over (runtime/driver.py ``run_with_signals``: every rank stops at
    the next agreement and saves), either signal ends the start-up (the config checks, the imports, the model load)
    where it is: the exception unwinds through the cleanups (the warm-up children, the process group), and ``main``
    says so and exits 130, as after a stop in the loop. (SIGTERM's default action used to end the process without a
    word.) Returns the handlers it replaced; none in a thread other than the main one, where Python allows none."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    rank = _env_rank()

    def stop(signum: int, _frame) -> None:
        raise KeyboardInterrupt(f"streamrft: stopped by {signal.Signals(signum).name} on rank {rank} during start-up, "
                                "before the first step; nothing trained, no checkpoint written")

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}


def _train_or_check(args: argparse.Namespace) -> int:
    from streamrft.config import load_config, validate_config

    cfg = load_config(args.config, args.overrides)
    world_size = _env_world_size()
    if not args.dry_run:
        from streamrft.learner.compile_warmup import start_compile_warmup, stop_compile_warmup

        # the warm-up children (train.compile_warmup, engine.kernel_warmup) start before the checks import torch,
        # transformers and the learner's modules: they need those imports too, and their head start is the gain
        start_compile_warmup(cfg)
    try:
        validate_config(cfg, world_size)
    except BaseException:
        if not args.dry_run:
            stop_compile_warmup()
        raise
    if args.dry_run:
        from streamrft.checkpoint.guard import check_resume

        resume = check_resume(cfg, world_size)  # what the run would do with output_dir, refused as it would be
        then = f"; it would resume from {resume}" if resume else ""
        print(f"streamrft: {args.config} is valid for world_size={world_size}{then}")
        return 0
    from streamrft.bytecode import warn_if_imports_from_source
    from streamrft.compose import train

    if _env_rank() == 0:  # the checks imported torch and transformers: say once if that compiled them from source
        warn_if_imports_from_source()
    summary = train(cfg)
    if _env_rank() == 0:
        print("summary: " + json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in summary.items()}), flush=True)
    return 0


def _env_world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def _env_rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def _serve_reward(argv: list[str]) -> int:
    from streamrft.rewards.service import serve_reward_main

    return serve_reward_main(argv)


def _serve_env(argv: list[str]) -> int:
    from streamrft.envs.service import serve_env_main

    return serve_env_main(argv)


def _serve_teacher(argv: list[str]) -> int:
    from streamrft.teacher.service import serve_teacher_main

    return serve_teacher_main(argv)


def _export(argv: list[str]) -> int:
    from streamrft.checkpoint.export import export_main

    return export_main(argv)


def _train_rm(argv: list[str]) -> int:
    from streamrft.rm.cli import train_rm_main

    return train_rm_main(argv)


def _eval_rm(argv: list[str]) -> int:
    from streamrft.rm.cli import eval_rm_main

    return eval_rm_main(argv)


def _eval(argv: list[str]) -> int:
    from streamrft.evaluate.cli import eval_main

    return eval_main(argv)


def _chat(argv: list[str]) -> int:
    from streamrft.chat import chat_main

    return chat_main(argv)


def _trajectories(argv: list[str]) -> int:
    from streamrft.sinks.cli import trajectories_main

    return trajectories_main(argv)


def _schema(_args: argparse.Namespace) -> int:
    from protocols.schema import main

    main()
    return 0


def _replay(argv: list[str]) -> int:
    from streamrft.replay_command import replay_main

    return replay_main(argv)


# Subcommands whose argument parsing belongs to their own module (they run without torch).
_PASSTHROUGH = {
    "replay": _replay,
    "serve-reward": _serve_reward,
    "serve-env": _serve_env,
    "serve-teacher": _serve_teacher,
    "trajectories": _trajectories,
    "export": _export,
    "train-rm": _train_rm,
    "eval-rm": _eval_rm,
    "eval": _eval,
    "chat": _chat,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrft", description="Streaming reinforcement fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy: streamrft train CONFIG.yaml key=value ...")
    train.add_argument("config", help="YAML or TOML config file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10")
    train.add_argument("--dry-run", action="store_true", help="validate the config and exit")
    train.set_defaults(func=_train)
    schema = sub.add_parser("schema", help="print the JSON Schema of every wire message")
    schema.set_defaults(func=_schema)
    sub.add_parser("serve-reward", help="serve a reward function over ZeroMQ or HTTP (see its --help)")
    sub.add_parser("serve-env", help="serve an environment's episodes over ZeroMQ or HTTP (see its --help)")
    sub.add_parser("serve-teacher", help="serve teacher log-probs for on-policy distillation (see its --help)")
    sub.add_parser("train-rm", help="train a scalar or generative reward model: streamrft train-rm CONFIG (see its --help)")
    sub.add_parser("eval-rm", help="pairwise accuracy of a reward model on a held-out split (see its --help)")
    sub.add_parser("eval", help="pass@1, pass@k and maj@k of a policy on a benchmark file (see its --help)")
    sub.add_parser("chat", help="a quick interactive check of a model directory (see its --help)")
    sub.add_parser("export", help="write a Hugging Face model directory from a checkpoint (see its --help)")
    sub.add_parser("trajectories", help="analyze or render trajectory files (see its --help)")
    sub.add_parser("replay", help="re-train a run's recorded batches and check its losses bitwise (see its --help)")
    return parser


def enable_crash_stacks() -> None:
    """A process that dies of a fatal signal (a native library's abort or segfault) prints every thread's Python
    stack to stderr first: otherwise a training rank's log ends without a word and torchrun reports only
    "exitcode -6" (a reward service's, an engine process's likewise)."""
    try:
        faulthandler.enable(all_threads=True)
    except (OSError, ValueError, RuntimeError):  # stderr has no file descriptor (captured in-process, or None)
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A reader that closes the pipe early (``streamrft schema | head -1``) ends
    the command quietly with 141 (128 + SIGPIPE, what a shell reports for ``cat`` in that pipe)."""
    enable_crash_stacks()
    try:
        try:
            return _run(sys.argv[1:] if argv is None else argv)
        finally:  # also after --help's SystemExit: buffered output meets a closed pipe here, not at exit
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_is_broken():
            raise  # a socket's broken pipe (a service's peer went away) is a real error
        # Point stdout at /dev/null: the interpreter flushes it again at exit and would print
        # "Exception ignored ... BrokenPipeError" (the recipe in Python's signal module docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _stdout_is_broken() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports POLLERR on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno (stdout replaced) or no poll on this platform
        return False


def _run(argv: list[str]) -> int:
    if argv and argv[0] in _PASSTHROUGH:
        return _PASSTHROUGH[argv[0]](argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow flags (`train CONFIG --dry-run a.b=1`): key=value leftovers are overrides.
    if extra and args.command == "train" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from streamrft.config import ConfigError
    from streamrft.data import DataError
    from streamrft.runtime.failure_policy import FailurePolicyError

    try:
        return args.func(args)
    except (ConfigError, DataError) as exc:
        print(f"streamrft: error: {exc}", file=sys.stderr)
        return 2
    except FailurePolicyError as exc:  # too many samples failed: the cause, not a traceback
        print(f"streamrft: error: {exc}", file=sys.stderr, flush=True)
        return 3
    except RuntimeError as exc:  # checkpoint.async_save: the background write failed or timed out, said as such
        from streamrft.checkpoint.background import CheckpointSaveError  # (imported here: it loads torch)

        if not isinstance(exc, CheckpointSaveError):
            raise
        print(f"streamrft: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except OSError as exc:  # a checkpoint save on a full disk / past a file-size limit: said as such, no traceback
        from streamrft.checkpoint.manager import CheckpointWriteError

        if not isinstance(exc, CheckpointWriteError):
            raise
        print(f"streamrft: error: {exc.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(str(exc) or "streamrft: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
