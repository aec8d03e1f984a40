"""The options of the `audit` commands: one typed record per pipeline, made once and passed whole.

The CLI makes the record from its flags (auditor.cli); a caller in Python makes it from keywords
(`RunOptions.checked(steps=30)`), validated as the flags are: a value out of range is an
OptionError naming the option. `audit run` hands its record on whole, serialised once (`encode`):
to the audited child (auditor.capture.wire.ChildRequest), to each rank of a launch and to each
--verify re-run (`audit run --options-json`). A new flag is one field here and one click option.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from auditor.findings import SEVERITIES

# The ranges the numbers are checked against (the CLI's click types use the same): memory between
# a MiB and a PiB, steps up to a billion, a day of waiting.
MIN_GIB, MAX_GIB = 2.0 ** -10, 2.0 ** 20
MAX_STEPS = 10 ** 9
MAX_SECONDS = 86_400.0
MIN_TRACE_MB, MAX_TRACE_MB = 0.001, 2.0 ** 30  # (a kB to a PiB of trace: beyond it a bound is no bound)
DEFAULT_RANK_TIMEOUT_S = 120.0  # how long the merging rank waits for the others' evidence (--rank-timeout)

GiB = Annotated[float, msgspec.Meta(ge=MIN_GIB, le=MAX_GIB)]
Steps = Annotated[int, msgspec.Meta(ge=0, le=MAX_STEPS)]


class OptionError(ValueError):
    """An option's value the record refuses: `option` (its field; None: the record as a whole)
    and why, as one line."""

    def __init__(self, option: str | None, why: str) -> None:
        super().__init__(f"{option}: {why}" if option else why)
        self.option, self.why = option, why


class OutputOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What every auditing command shares: where its outputs go and which findings count."""

    out: Path | None = None  # (None: audit-out/<name>-<timestamp>)
    fail_on: Literal[SEVERITIES] | None = None  # type: ignore[valid-type]
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    quiet: bool = False
    verbose: bool = False  # the summary in full (auditor.reports.terminal.summary_lines)

    @classmethod
    def checked(cls: type[T], **given: Any) -> T:
        """The record of `given` (keywords, by field name), validated: OptionError otherwise."""
        try:
            return msgspec.convert(given, cls, dec_hook=_decode_path)
        except msgspec.ValidationError as e:
            raise OptionError(*_phrase(str(e))) from None


T = TypeVar("T", bound=OutputOptions)


class DeviceOptions(OutputOptions, kw_only=True):
    """The device the evidence is judged on: a device model (`--device`) and its memory."""

    device: str | None = None
    device_memory: GiB | None = None


class RunOptions(DeviceOptions, kw_only=True):
    """`audit run`: how the target is run, recorded and reported."""

    steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_STEPS)] = 50
    skip: Steps = 0
    to_end: bool = False
    profile: bool = True
    profile_memory: GiB | None = None
    trace_size: Annotated[float, msgspec.Meta(ge=MIN_TRACE_MB, le=MAX_TRACE_MB)] | None = None
    rehearse: bool | None = None  # (None: when the target asks for CUDA and none is present)
    numerics: bool = True
    open_report: bool = False
    tensorboard: bool = False
    nproc_per_node: Annotated[int, msgspec.Meta(ge=1)] | None = None
    rank_timeout: Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)] = DEFAULT_RANK_TIMEOUT_S
    baseline: Path | None = None
    verify: bool = False
    digest: bool = False  # (the trained weights' digest at the end; --verify's re-runs ask for it)

    @property
    def rehearse_mode(self) -> str:
        """"auto", "on" or "off" (auditor.capture.rehearsal.install)."""
        return "auto" if self.rehearse is None else "on" if self.rehearse else "off"

    @property
    def records_digest(self) -> bool:
        """Whether the child records the weights' digest: --verify compares them."""
        return self.digest or self.verify


class AnalyzeOptions(DeviceOptions, kw_only=True):
    """`audit analyze`: where a job's per-rank traces are reduced, and whose sources are quoted."""

    engine: Literal["local", "ray", "dask"] | None = None
    address: str | None = None
    workers: Annotated[int, msgspec.Meta(ge=1)] | None = None
    source_roots: tuple[Path, ...] = ()


class CheckpointOptions(OutputOptions, kw_only=True):
    """`audit checkpoint`: the config the checkpoint is compared with."""

    against: Path | None = None


S = TypeVar("S", bound=msgspec.Struct)


def encode(record: msgspec.Struct) -> str:
    """A record (options, or one that holds them) as one JSON text: an argv value."""
    return msgspec.json.encode(record, enc_hook=_encode_path).decode()


def decode(text: str | bytes, kind: type[S]) -> S:
    """The record `encode` wrote, validated: OptionError otherwise."""
    try:
        return msgspec.json.decode(text, type=kind, dec_hook=_decode_path)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise OptionError(*_phrase(str(e))) from None


def _encode_path(obj: Any) -> Any:
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise NotImplementedError(type(obj).__name__)


def _decode_path(kind: type, obj: Any) -> Any:
    if kind is Path and isinstance(obj, (str, os.PathLike)):
        return Path(obj)
    raise NotImplementedError(kind.__name__)


def _phrase(error: str) -> tuple[str | None, str]:
    """msgspec's "Expected `int` >= 1 - at `$.steps`" as ("steps", "expected `int` >= 1")."""
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", error)
    if unknown:
        return unknown.group(1), "no such option"
    what, sep, where = error.rpartition(" - at `$.")
    if not sep:
        return None, error
    return where.rstrip("`").split("[")[0].split(".")[0], f"{what[:1].lower()}{what[1:]}"
