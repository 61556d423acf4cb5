"""The `graphopt` command group and what every command shares: exit codes, one-line errors, stderr.

Exit codes (every command): 0 done; 1 a check or gate failed; 2 bad usage or bad input;
3 internal error. stdout carries a command's product (--json, listings); people read stderr.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import traceback
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console

from graphopt import __version__
from graphopt.errors import GraphoptError, InputError
from graphopt.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

EXIT_CODES = """\b
Exit codes:
  0  done
  1  a check or gate failed (numerics, --check-optimized)
  2  bad usage or bad input (one line naming the file and the problem)
  3  internal error (one line naming the pass; the traceback with --debug)"""


class State:
    debug = False
    quiet = False


def stderr() -> Console:
    return Console(stderr=True, quiet=State.quiet, highlight=False)


def fail(message: str, code: int) -> None:
    click.echo(f"graphopt: error: {message}", err=True)
    sys.exit(code)


def guarded(func: F) -> F:
    """Add --quiet/--debug to a command and turn every failure into one line and its exit code."""

    def wrapper(*args: Any, quiet: bool = False, debug: bool = False, **kwargs: Any) -> Any:
        State.quiet = State.quiet or quiet
        State.debug = State.debug or debug
        try:
            return func(*args, **kwargs)
        except click.exceptions.Exit:
            raise
        except (click.ClickException, click.Abort):
            raise
        except GraphoptError as err:
            if State.debug:
                traceback.print_exc()
            fail(str(err), err.exit_code)
        except KeyboardInterrupt:
            fail("interrupted", 3)
        except Exception as err:  # the last line of defence: one line, never a traceback
            if State.debug:
                traceback.print_exc()
            fail(f"internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)", 3)

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    wrapper = click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")(wrapper)
    wrapper = click.option("-q", "--quiet", is_flag=True, help="Print nothing on stderr except errors.")(wrapper)
    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="graphopt")
@click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on stderr except errors.")
def cli(debug: bool, quiet: bool) -> None:
    """graphopt: make ONNX models smaller and faster, and prove they still compute the same.

    \b
    Examples:
      graphopt run model.onnx -o model.opt.onnx --report report.json
      graphopt run models/ -o optimized/ -j 2          # a whole folder
      graphopt inspect model.onnx
      graphopt convert model.onnx model.json           # a readable, diffable graph
      graphopt check model.onnx model.opt.onnx
      graphopt passes
    """
    State.debug = debug
    State.quiet = quiet
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr)


def with_settings(func: F) -> F:
    """Add one option per run setting (graphopt.settings.Settings) and hand the command the
    ones given as ``settings``, a dict; --debug turns on the verify setting."""
    fields = dataclasses.fields(Settings)
    hints = typing.get_type_hints(Settings)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {f.name: kwargs.pop(f.name) for f in fields}
        chosen = {name: value for name, value in given.items() if value not in (None, ())}
        if State.debug or kwargs.get("debug"):
            chosen.setdefault("verify", True)
        return func(*args, settings=chosen, **kwargs)

    for option in reversed(fields):
        flag = "--" + option.name.replace("_", "-")
        help_text = option.metadata.get("help", "")
        annotation = hints[option.name]
        if annotation is bool:
            decorator = click.option(f"{flag}/--no-{flag[2:]}", option.name, default=None, help=help_text)
        elif typing.get_origin(annotation) is typing.Literal:
            choices = click.Choice([str(a) for a in typing.get_args(annotation)])
            decorator = click.option(flag, option.name, type=choices, default=None, help=help_text)
        elif typing.get_origin(annotation) is list:
            decorator = click.option(flag, option.name, multiple=True, help=help_text + " (repeatable)")
        else:
            decorator = click.option(flag, option.name, type=annotation, default=None, help=help_text)
        wrapper = decorator(wrapper)
    return wrapper  # type: ignore[return-value]


def parse_dims(values: Sequence[str]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for item in values:
        name, sep, number = item.partition("=")
        if not sep or not name or not number.strip().isdigit() or int(number) < 1:
            raise InputError(f"--dim {item!r}: expected NAME=VALUE with a positive integer")
        dims[name.strip()] = int(number)
    return dims


def emit(report: dict[str, Any], path: Path | None, as_json: bool) -> None:
    from graphopt.report import dumps, write_report

    if path is not None:
        write_report(report, path)
    if as_json:
        sys.stdout.write(dumps(report))
