"""``explain evaluate``: attribution and metric jobs over a data set, alone or under torchrun.

The same command line runs in one process or in N under
``torchrun --nproc_per_node=N -m explain_core evaluate …``: each rank computes its own chunks of
the data set and rank 0 merges them exactly, writes the outputs and prints the summary (the other
ranks print nothing).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, NoReturn

from explain_core.cli.common import (
    add_model_arguments,
    add_option_argument,
    check_not_overwriting,
    load_model,
    output_path,
    parse_device,
    parse_options,
    run_model,
)
from explain_core.distributed.jobs import Job, JobArgument, registered_jobs

NAME = "evaluate"
HELP = "attribution and metric jobs over a data set (runs under torchrun)"
DESCRIPTION = (
    "Build a model from package.module:factory, load its weights and run an evaluation job over "
    "a bundled data set: attribution maps to resumable shards, localisation, pixel removal, CSC, "
    "or a job a plugin adds (REM parse-tree dictionaries). Runs unchanged under torchrun "
    "--nproc_per_node=N (gloo on CPU, NCCL with --device cuda); results are merged exactly on "
    "rank 0, which writes them and prints the summary."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    add_model_arguments(parser)
    parser.add_argument(
        "--dataset",
        required=True,
        choices=("digits", "cluttered"),
        help="digits: the test split (450 images); cluttered: digits on cluttered canvases "
        "with ink masks",
    )
    jobs = registered_jobs()
    parser.add_argument(
        "--job",
        required=True,
        choices=list(jobs),
        help="what to compute: "
        + "; ".join(f"{name}: {job.summary}" for name, job in jobs.items() if job.summary),
    )
    parser.add_argument("--method", help="registered attribution method (for jobs that need one)")
    parser.add_argument("--out", type=output_path, required=True, help="output folder")
    parser.add_argument(
        "--batch-size", type=_positive_int, default=64, help="samples per pass (64)"
    )
    parser.add_argument(
        "--shard-size",
        type=_positive_int,
        default=256,
        help="samples per chunk and shard file (256)",
    )
    parser.add_argument("--limit", type=int, help="only the first N samples")
    parser.add_argument("--image-size", type=int, default=8, help="digits: side length (8)")
    parser.add_argument(
        "--canvas-size", type=int, default=32, help="cluttered: canvas side length (32)"
    )
    parser.add_argument("--count", type=int, default=200, help="cluttered: samples (200)")
    parser.add_argument(
        "--target",
        choices=("label", "predicted"),
        default="label",
        help="class to explain (default: the label)",
    )
    parser.add_argument(
        "--device", type=parse_device, default="cpu", help="cpu (default), cuda or cuda:N"
    )
    parser.add_argument("--threads", type=int, help="torch threads per process")
    add_option_argument(parser, "method option, repeatable (e.g. --option steps=32)")
    add_job_arguments(parser.add_argument_group("job options"), jobs)
    _usage_errors_once_per_machine(parser)


def _usage_errors_once_per_machine(parser: argparse.ArgumentParser) -> None:
    """Let only the first process of each machine print a usage error.

    Under torchrun every process parses the same command line, so each would print the same
    message; the others still exit with status 2. Per machine rather than rank 0 only, so that a
    problem of one machine (e.g. ``--device cuda`` where it has no GPU) is still reported.
    """
    report = parser.error

    def error(message: str) -> NoReturn:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            parser.exit(2)
        report(message)

    parser.error = error  # type: ignore[method-assign]


def _positive_int(text: str) -> int:
    """``--batch-size``, ``--shard-size``: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, e.g. 64; got {text!r}")
    return value


def add_job_arguments(group: argparse._ArgumentGroup, jobs: dict[str, Job]) -> None:
    """Every job's flags, prefixed with its name in the help (a flag taken stays the first's)."""
    taken: dict[str, str] = {}
    for name, job in jobs.items():
        for argument in job.arguments:
            if argument.flag in taken:
                continue
            taken[argument.flag] = name
            extra: dict[str, Any] = {"metavar": argument.flag.lstrip("-").replace("-", "_").upper()}
            if argument.type is not None:
                extra["type"] = argument.type
            if argument.choices is not None:  # argparse shows the choices instead
                extra["choices"] = argument.choices
                del extra["metavar"]
            group.add_argument(
                argument.flag,
                dest=_dest(argument),
                default=argument.default,
                help=f"{name}: {argument.help}",
                **extra,
            )


def _dest(argument: JobArgument) -> str:
    return "job_" + argument.flag.lstrip("-").replace("-", "_")


def _job_options(args: argparse.Namespace, job: Job) -> dict[str, Any]:
    """The selected job's options from its flags."""
    return {argument.option: getattr(args, _dest(argument)) for argument in job.arguments}


def run(args: argparse.Namespace) -> int:
    """Run the job; rank 0 prints the summary and errors, the other ranks exit quietly."""
    from explain_core.errors import ExplainError

    try:
        return _run(args)
    except (ExplainError, OSError):
        if getattr(args, "debug", False) or os.environ.get("RANK", "0") == "0":
            raise
        return 1  # rank 0 reports the same error; one message is enough


def _run(args: argparse.Namespace) -> int:
    import torch

    from explain_core.distributed import evaluate, init_distributed
    from explain_core.distributed.context import shutdown_distributed
    from explain_core.distributed.gather import all_gather_objects
    from explain_core.errors import DistributedError, InvalidInputError
    from explain_core.files import check_output_folder

    if args.threads is not None:
        if args.threads < 1:
            raise InvalidInputError(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)
    job = registered_jobs()[args.job]
    if job.needs_method and args.method is None:
        raise InvalidInputError(f"--job {args.job} needs --method (a registered method)")
    if args.limit is not None and args.limit < 1:
        raise InvalidInputError(f"--limit must be >= 1; got {args.limit}")
    options = parse_options(args.option)
    check_output_folder(args.out)
    check_not_overwriting(_outputs(args), [("--weights file", args.weights)])
    context = init_distributed(args.device)
    try:
        model, data, problem = _load(args)
        # Every rank must have its model and data before any rank waits in a collective.
        statuses = all_gather_objects(None if problem is None else str(problem), context)
        if problem is not None:
            raise problem
        failed = [f"rank {rank}: {status}" for rank, status in enumerate(statuses) if status]
        if failed:
            raise DistributedError("loading failed on " + "; ".join(failed))
        job_options = _job_options(args, job)
        result = evaluate(
            args.job,
            model,
            data,
            method=args.method,
            out_dir=args.out,
            batch_size=args.batch_size,
            shard_size=args.shard_size,
            target=args.target,
            device=context.device,
            method_options=options,
            **job_options,
        )
        if context.is_main:
            print("\n".join(result.summary_lines()))
    finally:
        shutdown_distributed()
    return 0


def _outputs(args: argparse.Namespace) -> list[Path]:
    """The files the job writes in ``--out`` (the shards' own folder aside)."""
    from explain_core.distributed.store import INDEX_NAME

    if args.job == "attributions":
        return [args.out / INDEX_NAME]
    return [args.out / f"{args.job}.json", args.out / f"{args.job}.safetensors"]


def _load(args: argparse.Namespace) -> tuple[Any, Any, Exception | None]:
    """Model and data set, or the error that prevented loading them."""
    from explain_core.distributed import load_dataset
    from explain_core.errors import ExplainError

    try:
        model = load_model(args)
        if args.dataset == "digits":
            data = load_dataset("digits", image_size=args.image_size)
        else:
            data = load_dataset("cluttered", canvas_size=args.canvas_size, count=args.count)
        if args.limit is not None:
            data = data.slice(0, min(args.limit, len(data)))
        _check_fit(args, model, data)
    except (ExplainError, OSError, ValueError) as error:
        return None, None, error
    return model, data, None


def _check_fit(args: argparse.Namespace, model: Any, data: Any) -> None:
    """Refuse a job the model cannot do, or data it cannot run on, before any work.

    Raises:
        InvalidInputError: Saying which option to change.
    """
    registered_jobs()[args.job].check_model(model)
    if len(data) == 0:
        return  # the job reports an empty data set itself
    size = "--image-size" if args.dataset == "digits" else "--canvas-size"
    hint = f"set {size} to the input size the model was built for"
    run_model(model, data.slice(0, min(2, len(data))).inputs, hint=hint)
