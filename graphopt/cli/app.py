"""The `graphopt` command group and what every command shares: exit codes, one-line errors, stderr.

Exit codes (every command): 0 done; 1 a check or gate failed; 2 bad usage or bad input;
3 internal error; each command's --help says which of them it uses. stdout carries a
command's product (--json, listings); people read stderr.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import sys
import traceback
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console

from graphopt.errors import GraphoptError, InputError, one_line
from graphopt.options import field_types
from graphopt.settings import Settings
from graphopt.version import __version__

F = TypeVar("F", bound=Callable[..., Any])


QUIET_HELP = "Print nothing on stderr except errors and warnings."


def exit_codes(failed: str | None = None) -> str:
    """The exit codes of one command, for its --help: ``failed`` says what makes it exit 1
    (None: it never does)."""
    lines = ["\b", "Exit codes:", "  0  done"]
    if failed is not None:
        lines.append(f"  1  {failed}")
    lines += [
        "  2  bad usage or bad input (one line naming the file and the problem)",
        "  3  internal error (one line; the traceback with --debug)",
    ]
    return "\n".join(lines)


class State:
    debug = False
    quiet = False
    model: str | None = None  # the one model a command works on: warnings name it


def _console(**options: Any) -> Console:
    console = Console(highlight=False, **options)
    if not console.is_terminal:
        # A CI log or a pipe: one line per message, whatever its length (rich would wrap at 80).
        console.soft_wrap = True
        console.width = 1 << 15
    return console


def stderr() -> Console:
    """Where people read progress, tables and diagnostics (silenced by --quiet)."""
    return _console(stderr=True, quiet=State.quiet)


def stdout() -> Console:
    """Where a listing command's product goes, so that it can be piped (never silenced)."""
    return _console()


def error_line(message: str) -> None:
    """One diagnostic line on stderr, --quiet or not."""
    click.echo(f"graphopt: error: {one_line(message)}", err=True)


def warning_line(message: str) -> None:
    """One warning line on stderr, --quiet or not."""
    click.echo(f"graphopt: warning: {one_line(message)}", err=True)


def fail(message: str, code: int) -> None:
    error_line(message)
    sys.exit(code)


def guarded(func: F) -> F:
    """Add --quiet/--debug to a command and turn every failure into one line and its exit code."""

    @functools.wraps(func)  # with the options of the decorators below it (--dim, ...), which raise inside it
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

    wrapper = click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")(wrapper)
    wrapper = click.option("-q", "--quiet", is_flag=True, help="Print nothing on stderr except errors and warnings.")(
        wrapper
    )
    return wrapper  # type: ignore[return-value]


# click >= 8.2 raises this for a bare `graphopt`; older versions print the help themselves.
_NO_ARGS: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _Commands(click.Group):
    """The command group; click's usage errors end in the same one line as every other error."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:  # type: ignore[override]
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        except _NO_ARGS as err:  # bare `graphopt`: the help, as click shows it
            err.show()
            sys.exit(err.exit_code)
        except click.UsageError as err:
            command = " ".join(["graphopt", *(err.ctx.command_path.split()[1:] if err.ctx else [])])
            message = " ".join(err.format_message().split())
            fail(f"{message} (see '{command} --help')", 2)
        except click.ClickException as err:
            fail(" ".join(err.format_message().split()), err.exit_code)
        except click.Abort:
            fail("interrupted", 3)
        if standalone_mode:
            sys.exit(result if isinstance(result, int) else 0)
        return result


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="graphopt")
@click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")
@click.option("-q", "--quiet", is_flag=True, help=QUIET_HELP)
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
    State.model = None
    _log_to_stderr(logging.DEBUG if debug else logging.WARNING)


class _StderrHandler(logging.Handler):
    """Log records as ``graphopt: warning: ...`` lines on the stderr of the moment (click's,
    so a test runner's capture sees them too)."""

    def emit(self, record: logging.LogRecord) -> None:
        from graphopt.report.console import naming

        message = record.getMessage() if State.model is None else naming(State.model, record.getMessage())
        click.echo(f"graphopt: {record.levelname.lower()}: {one_line(message)}", err=True)


def _log_to_stderr(level: int) -> None:
    logger = logging.getLogger("graphopt")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
        logger.propagate = False
    logger.setLevel(level)


def with_settings(func: F) -> F:
    """Add one option per run setting (graphopt.settings.Settings) and per pass knob (an
    option of a pass, graphopt.passes.base.Knob) and hand the command the ones given as
    ``settings``, a dict; --debug turns on the verify setting."""
    from graphopt.passes.base import pass_knobs

    hints = field_types(Settings)
    declared = [
        (f.name, "--" + f.name.replace("_", "-"), hints[f.name], f.metadata.get("help", ""))
        for f in dataclasses.fields(Settings)
    ]
    declared += [(k.name, k.flag, k.annotation, f"{k.help} (pass {k.pass_name})") for k in pass_knobs().values()]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name, *_ in declared}
        chosen = {name: value for name, value in given.items() if value not in (None, ())}
        if State.debug or kwargs.get("debug"):
            chosen.setdefault("verify", True)
        return func(*args, settings=chosen, **kwargs)

    for name, flag, annotation, help_text in reversed(declared):
        wrapper = _setting_option(name, flag, annotation, help_text)(wrapper)
    return wrapper  # type: ignore[return-value]


def with_pass_options(pass_name: str) -> Callable[[F], F]:
    """Add one option per option of the pass ``pass_name`` (``--time-budget``: the command is
    the pass's own, so no prefix) and hand the command ``options``, the pass's Options value."""
    from graphopt.passes.base import get_pass

    options_class = get_pass(pass_name).Options
    hints = field_types(options_class)
    fields = dataclasses.fields(options_class)

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = {f.name: kwargs.pop(f.name) for f in fields}
            chosen = {name: value for name, value in given.items() if value not in (None, ())}
            return func(*args, options=options_class(**chosen), **kwargs)

        for f in reversed(fields):
            flag = "--" + f.name.replace("_", "-")
            shown = f"{f.metadata.get('help', '')} (default {f.default})"
            wrapper = _setting_option(f.name, flag, hints[f.name], shown)(wrapper)
        return wrapper  # type: ignore[return-value]

    return decorate


_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_WHOLE = re.compile(r"[+-]?[0-9]+")


class Number(click.ParamType):
    """A finite number as people type it, in ASCII digits (with a point and an exponent unless
    ``whole``), from ``low`` to ``high``: Python's float() and int() also take 'nan', 'inf',
    '1_000' and the digits of other scripts."""

    def __init__(self, whole: bool = False, low: float = -math.inf, high: float = math.inf) -> None:
        self.whole, self.low, self.high = whole, low, high
        self.name = "integer" if whole else "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):  # a default, already a number
            return value
        text = str(value).strip()
        if not (_WHOLE if self.whole else _DECIMAL).fullmatch(text):
            self.fail(f"{value!r} is not a valid {self.name} (ASCII digits)", param, ctx)
        number = int(text) if self.whole else float(text)
        if not math.isfinite(number):
            self.fail(f"{value!r} is too large", param, ctx)
        if not self.low <= number <= self.high:
            bounds = f"from {self.low:g} to {self.high:g}" if math.isfinite(self.high) else f"at least {self.low:g}"
            self.fail(f"{value!r} is not {bounds}", param, ctx)
        return number


def _setting_option(name: str, flag: str, annotation: Any, help_text: str) -> Callable[[F], F]:
    if annotation is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)
    if typing.get_origin(annotation) is typing.Literal:
        choices = click.Choice([str(a) for a in typing.get_args(annotation)])
        return click.option(flag, name, type=choices, default=None, help=help_text)
    if typing.get_origin(annotation) is list:
        return click.option(flag, name, multiple=True, help=help_text + " (repeatable)")
    numbers = {int: Number(whole=True), float: Number()}
    return click.option(flag, name, type=numbers.get(annotation, annotation), default=None, help=help_text)


def with_check_options(func: F) -> F:
    """Add the numerics check's options (``run`` and ``check`` share them) and hand the
    command one ``numerics`` value (graphopt.numerics.options.CheckOptions), checked once;
    goes below ``guarded``, which turns a bad value into one line and exit 2."""
    from graphopt.numerics.budget import DEFAULT_MEMORY_BUDGET
    from graphopt.numerics.options import FIRST_RUN_SECONDS, TIME_FACTOR, CheckOptions, check_numbers

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        memory = kwargs.pop("check_memory")
        if memory is not None:  # as given, before a tiny value rounds to 0 bytes
            check_numbers(memory_budget=memory * 1e9)
        numerics = CheckOptions(
            dims=parse_dims(kwargs.pop("dims")),
            inputs=kwargs.pop("inputs"),
            atol=kwargs.pop("atol"),
            rtol=kwargs.pop("rtol"),
            memory_budget=None if memory is None else int(memory * 1e9),
            timeout=kwargs.pop("check_timeout"),
            required=kwargs.pop("require_check"),
            custom_op_libraries=tuple(kwargs.pop("custom_op_libraries")),
        )
        return func(*args, numerics=numerics, **kwargs)

    options = [
        click.option(
            "--dim",
            "dims",
            multiple=True,
            metavar="NAME=VALUE",
            help="Fix a dynamic dim for the check, by name or as INPUT[AXIS] for an unnamed one (repeatable).",
        ),
        click.option(
            "--inputs",
            type=click.Path(path_type=Path, exists=True, dir_okay=False),
            help="Check with these inputs (.npz by input name).",
        ),
        click.option("--atol", type=Number(), help="Element-wise check: absolute tolerance (with --rtol)."),
        click.option("--rtol", type=Number(), help="Element-wise check: relative tolerance (with --atol)."),
        click.option(
            "--require-check",
            is_flag=True,
            help="Exit 1 (and, for run, write nothing) when the check could not verify a model ('not checked').",
        ),
        click.option(
            "--check-memory",
            type=Number(),
            metavar="GB",
            help=f"GB of memory the check may use (default {DEFAULT_MEMORY_BUDGET / 1e9:g}); past it, 'not checked'.",
        ),
        click.option(
            "--check-timeout",
            type=Number(),
            metavar="SECONDS",
            help=f"Seconds the check may take (default: {TIME_FACTOR} times the original model's first run, at least"
            f" {FIRST_RUN_SECONDS:g}, which is also what that first run may take); past it, 'not checked'.",
        ),
        click.option(
            "--custom-op-library",
            "custom_op_libraries",
            multiple=True,
            type=click.Path(path_type=Path, exists=True, dir_okay=False),
            metavar="PATH",
            help="Register this onnxruntime custom-op library in the check's sessions (repeatable).",
        ),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper  # type: ignore[return-value]


# The largest value --dim takes: onnxruntime's kernels index most tensors with 32-bit ints.
MAX_DIM = 2**31 - 1


def parse_dims(values: Sequence[str]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for item in values:
        name, sep, number = item.partition("=")
        if not sep or not name or not _WHOLE.fullmatch(number.strip()) or not 1 <= int(number) <= MAX_DIM:
            raise InputError(f"--dim {item!r}: expected NAME=VALUE with VALUE a whole number from 1 to {MAX_DIM}")
        name = name.strip()
        if dims.get(name, int(number)) != int(number):
            raise InputError(f"--dim {item!r}: {name} is already {dims[name]} (conflicting --dim options)")
        dims[name] = int(number)
    return dims


def emit(report: dict[str, Any], path: Path | None, as_json: bool) -> None:
    from graphopt.report import dumps, write_report

    if path is not None:
        write_report(report, path)
    if as_json:
        sys.stdout.write(dumps(report))
