"""The numerics collector's records (auditor.capture.numerics); `numerics_view.NumericsView` reads them.

Per step, `StepRecord.numerics` is a `NumericsStep`; at the end of the run, `Evidence.numerics`
is a `NumericsFinal`. Non-finite floats are the strings "nan", "inf", "-inf" (JSON has no NaN):
fields typed `float | str | None` hold them, and `val` reads them back as floats.

Step records refer to call sites, modules and lists of parameter names by id. These tables are
sent incrementally: each entry goes out once, in the first record (step or final) after it was
made, so a reader joins the tables of every record (`NumericsView` does).

A hazard value is per site kind: log/sqrt/pow the smallest input, div the smallest |denominator|,
exp the largest input, norm the smallest norm, fp16 the largest |value|.
"""
from __future__ import annotations

import math
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

class Where(msgspec.Struct, omit_defaults=True):
    """The user's line of a call."""

    file: str
    line: int
    function: str
    span: list[int] | None = None  # where on the line the call is: [line, end line, column, end column]


class Site(msgspec.Struct, omit_defaults=True):
    """A call site: one op at one user's line (`sites` table)."""

    id: int
    op: str | None  # the op's readable name: torch.log, Tensor.div, torch.nn.Linear, torch.compile(Net)
    where: Where | None  # None when no user's line was found
    hazard: str | None = None  # the hazard kind: log, log1p, div, exp, sqrt, pow, norm, fp16


NO_SITE = Site(id=-1, op=None, where=None)  # what a reader gets for a site id no table names


class ModuleInfo(msgspec.Struct):
    """A module the steps ran (`modules` table)."""

    id: int
    name: str  # qualified name under its root module ("" for the root itself)
    type: str  # class name
    root: str  # class name of the root module it was found under


class ParamList(msgspec.Struct):
    """A list of parameters named in step records (`param_lists` table), in the record's order."""

    names: list[str]  # qualified parameter names
    layers: list[str]  # the qualified name of the module owning each


class OptStep(msgspec.Struct, omit_defaults=True):
    """One optimizer step of a training step. Fields left None were not recorded for it."""

    opt: int  # the optimizer's id (its "optimizer" event)
    site: int | None = None  # the site of the `optimizer.step` call
    sched_epochs: dict[str, int | None] = {}  # scheduler id -> its last_epoch at this step
    lrs: list[int | float | str | None] = []  # the learning rate of each param group
    grads: int | None = None  # id in `param_lists` of the parameters `grad_norms` are of
    grad_norm: float | str | None = None  # the global gradient norm ("nan" when any is non-finite)
    grad_norms: list[float | str] | None = None  # one per parameter with a gradient
    grad_nonfinite: int | None = None  # how many gradients were non-finite
    no_grads: bool | None = None  # True: no parameter of the optimizer had a gradient (every .grad None)
    grad_nonfinite_params: list[str] | None = None  # their names (20 at most), when any
    fp16_grads: int | None = None  # float16 gradients of float16 weights (amp-unscaled), when any
    compiled: bool | None = None  # True: the step ran inside code torch.compile compiled
    # "measured": weights measured after the update; "trusted": a safe update of weights known
    # finite, not measured again (see capture.numerics.optimizer)
    params_checked: str | None = None
    param_max_abs: float | str | None = None  # the largest |weight| after the update (measured)
    param_nonfinite: int | None = None  # how many weights were non-finite after it (measured)
    param_nonfinite_params: list[str] | None = None  # their names (20 at most; measured)
    # Added by the reader (NumericsView), not recorded: the largest gradient norms by parameter,
    # [name, norm], and by layer, [layer, norm, share of the squared global norm]
    top_params: list[list[Any]] | None = None
    top_layers: list[list[Any]] | None = None


class Range(msgspec.Struct, omit_defaults=True):
    """The range of one input or output of the call an origin names."""

    min: float | str | None  # None for an input whose range is not known (written in place)
    max: float | str | None
    finite: bool
    abs: bool = False  # True: a weight's range after an update, ±max|w|
    measured_at_step: int | None = None  # a weight's range measured at an earlier step
    param: str | None = None  # the parameter this input is


class Origin(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where a step's non-finite values started (only in the first few steps where the loss, a
    gradient or a parameter is non-finite). The fields after `phase` depend on the phase."""

    step: int
    nonfinite: list[str]  # what went non-finite: loss, gradient, parameter
    ops_checked: int | None = None  # calls checked in the step
    hazards: list[list[Any]] | None = None  # the step's hazards: [site id, value]
    # forward: a call made them; input: a call received them from outside the step's checked
    # calls; backward: the backward pass (`function`: in a user's hand-written backward);
    # optimizer: the update; unknown
    phase: str
    function: str | None = None  # the hand-written backward ("Name.backward")
    op_index: int | None = None  # the call's index among the step's checked calls
    # the call's site (the optimizer step's, for phase optimizer; the backward call's, for phase backward)
    site: int | None = None
    module: int | None = None  # the module running it (-1: none)
    inputs: list[Range] | None = None  # the call's inputs (8 at most)
    outputs: list[Range] | None = None  # its outputs (4 at most)
    # {"kind": ..., and per kind}: log-of-zero/log-of-negative/sqrt-of-negative min_input,
    # division-by-zero min_abs_denominator, exp-overflow max_input, fp16-overflow limit,
    # nonfinite-input input (index) and param, backward singular_sites ([site, value] of the
    # hazards at 0); compiled, overflow, invalid, update, unknown: the kind alone
    hazard: dict[str, Any] = {}
    params: list[str] | None = None  # parameters whose gradients (backward) or values (optimizer) went
    opt: int | None = None  # the optimizer of those parameters


class ScalerUpdate(msgspec.Struct):
    """One GradScaler.update: its scale before and after."""

    scaler: int  # the scaler's id (its "grad_scaler" event; -1 when unknown)
    before: float | str | None
    after: float | str | None


class NumericsStep(msgspec.Struct):
    """The numerics collector's record of one step (`StepRecord.numerics`)."""

    ops: int = 0  # calls checked (deferred calls included)
    nonfinite_ops: int = 0  # of them, those with a non-finite output
    nonfinite_sites: list[int] = []  # their sites
    dropped: int = 0  # calls past the per-step limit, not recorded
    backward: int = 0  # backward passes the step started
    check_ms: float | None = None  # the checks' own time: in the step and in building this record
    check_in_step_ms: float | None = None  # the part of check_ms inside the step's wall time
    loss: float | str | None = None  # the last loss a backward pass started from
    loss_finite: bool | None = None  # whether every loss was finite (None: no loss)
    losses: int = 0  # losses seen
    opt_steps: list[OptStep] = []
    hazards: list[list[Any]] = []  # [site id, value]: how close each hazard site came (see above)
    autocast: list[list[int]] = []  # [autocast site id (its "autocast" event), times entered]
    scaler_updates: list[ScalerUpdate] = []
    scaler_scale_calls: int = 0  # GradScaler.scale calls
    # configuration events, in order: {"event": kind, "step": step (-1 before the first),
    # "where": {file, line, function} or None, and the event's own data}; kinds: optimizer,
    # optimizer.load_state_dict, scheduler, scheduler.load_state_dict, autocast, grad_scaler,
    # clip_scaled (see capture.numerics.config_probes and amp_probes)
    events: list[dict[str, Any]] = []
    sites: dict[str, Site] = {}  # new sites, by id
    modules: dict[str, ModuleInfo] = {}  # new modules, by id
    param_lists: dict[str, ParamList] = {}  # new lists of parameter names, by id
    origin: Origin | None = None
    # Present only when the collector's own code failed (UNSET, and absent on the wire, otherwise):
    error: str | None | UnsetType = UNSET  # building this record failed: it holds only the times and tables
    collector_errors: int | None | UnsetType = UNSET  # failures of the collector's own code so far
    collector_error: str | None | UnsetType = UNSET  # the last of them


class NumericsFinal(msgspec.Struct):
    """The numerics collector's record at the end of the run (`Evidence.numerics`)."""

    errors: int = 0  # failures of the collector's own code
    error: str | None = None  # the last of them
    checking: bool = True  # False: op checking switched itself off after too many failures
    events: list[dict[str, Any]] = []  # events after the last step (see NumericsStep.events)
    sites: dict[str, Site] = {}  # table entries made after the last step
    modules: dict[str, ModuleInfo] = {}
    param_lists: dict[str, ParamList] = {}


def val(x: Any) -> float | None:
    """A number from the evidence: the collector writes non-finite floats as "nan"/"inf"/"-inf"."""
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def num(x: float) -> float | str:
    """The inverse of `val`: non-finite floats as the collector writes them (JSON has no NaN)."""
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
