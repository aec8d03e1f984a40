"""torch's private surface, in one place: every private attribute, class, method and message text the
auditor relies on, with the torch versions that have it and what the auditor does where it is absent.

The supported range is torch FLOOR (2.4) and later. `PIECES` lists each private piece by its dotted
path (`module:attribute.attribute`), the modules that use it, the first minor version that has it
and the first that no longer does; tests/test_torch_surface.py checks each against the installed
torch, so a release that moves one fails one test naming it. What differs between supported
versions is looked up through the helpers below (the newer form first, then the older one, never by
the version number alone); what every supported version has is read where it is used, and listed
here so that its test guards it."""
from __future__ import annotations

import abc
import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

# (torch is imported where a helper needs it: the launching process reads the floor without it)
FLOOR = (2, 4)


@dataclass(frozen=True)
class Piece:
    """One private piece: `path` is `module:attr.attr` (module imported, then attributes read);
    present from minor version `since` up to, not including, `until` (None: still there)."""
    path: str
    used_by: str
    since: tuple[int, int] = FLOOR
    until: tuple[int, int] | None = None
    instead: str = ""  # what stands in where it is absent ("" where it is present on every supported torch)

    def expected(self, version: tuple[int, int]) -> bool:
        return self.since <= version and (self.until is None or version < self.until)


PIECES: tuple[Piece, ...] = (
    # torch function modes: the probes and the rehearsal step off and back on the mode stack
    Piece("torch._C:DisableTorchFunction", "capture/unseen.py, rehearsal/clock.py"),
    Piece("torch._C:_len_torch_function_stack", "capture/unseen.py, numerics/stack.py"),
    Piece("torch._C:_get_function_stack_at", "capture/unseen.py, numerics/stack.py"),
    Piece("torch._C:_pop_torch_function_stack", "capture/unseen.py, numerics/stack.py"),
    Piece("torch._C:_push_on_torch_function_stack", "capture/unseen.py, numerics/stack.py"),
    Piece("torch.overrides:_get_current_function_mode_stack", "rehearsal/device.py"),
    Piece("torch._C:_set_grad_enabled", "numerics/stack.py"),
    Piece("torch._C._autograd:_profiler_enabled", "numerics/stack.py"),
    Piece("torch._C:TensorBase", "rehearsal/ops.py, rehearsal/device.py, numerics/values.py"),
    Piece("torch._C:Generator", "rehearsal/device.py"),
    Piece("torch._C._nn:linear", "rehearsal/ops.py"),
    Piece("torch._C._nn:_parse_to", "rehearsal/device.py"),
    Piece("torch._C._functorch:is_functorch_wrapped_tensor", "numerics/tensors.py"),
    Piece("torch._utils:_get_obj_state", "rehearsal/device.py (the marks kept out of pickles)"),
    Piece("torch._utils:ExceptionWrapper", "rehearsal/data.py"),
    Piece("torch.utils._device:DeviceContext", "rehearsal/device.py"),
    Piece("torch.utils._device:DeviceContext.__torch_function__", "rehearsal/device.py (the user's calls under it)"),
    Piece("torch.utils.data._utils.pin_memory:pin_memory", "rehearsal/data.py"),
    # torch.func's wrapping, which keeps the rehearsal's GPU mark (rehearsal/functorch_marks.py)
    Piece("torch._functorch.vmap:_add_batch_dim", "rehearsal/functorch_marks.py"),
    Piece("torch._functorch.vmap:_remove_batch_dim", "rehearsal/functorch_marks.py"),
    Piece("torch._functorch.eager_transforms:_wrap_for_grad", "rehearsal/functorch_marks.py"),
    Piece("torch._functorch.eager_transforms:_unwrap_for_grad", "rehearsal/functorch_marks.py"),
    Piece("torch._functorch.eager_transforms:_wrap_functional_tensor", "rehearsal/functorch_marks.py"),
    Piece("torch._functorch.eager_transforms:_unwrap_functional_tensor", "rehearsal/functorch_marks.py"),
    Piece("torch._functorch.autograd_function:_add_batch_dim", "rehearsal/functorch_marks.py"),
    Piece("torch._functorch.autograd_function:_wrap_for_grad", "rehearsal/functorch_marks.py"),
    Piece("torch._functorch.autograd_function:_unwrap_for_grad", "rehearsal/functorch_marks.py"),
    Piece("torch._C._nn:scaled_dot_product_attention", "rehearsal/ops.py (its FLOPs)"),
    # torch's lazy submodules: the profiler is started without importing inductor (capture/child.py)
    Piece("torch:__getattr__", "capture/child.py"),
    # torch.compile: the auditor's frames are skipped, compiled calls run without the probes' mode
    Piece("torch._dynamo.eval_frame:skip_code", "capture/unseen.py"),
    Piece("torch._dynamo.eval_frame:_TorchDynamoContext.__call__", "capture/unseen.py"),
    Piece("torch._dynamo:config", "capture/unseen.py"),
    Piece("torch._dynamo.utils:counters", "numerics/collector.py (whether anything was compiled)"),
    Piece("torch._dynamo:assume_constant_result", "capture/unseen.py, rehearsal/device.py (its mark: DYNAMO_CONSTANT)"),
    # activation checkpointing's recompute, re-run under the rehearsal (rehearsal/device.py)
    Piece("torch.utils.checkpoint:CheckpointFunction.forward", "rehearsal/device.py (use_reentrant=True)"),
    Piece("torch.utils.checkpoint:_CheckpointFrame", "rehearsal/device.py (use_reentrant=False)"),
    Piece("torch.utils.checkpoint:_CheckpointFrame.save_inputs", "rehearsal/device.py", since=(2, 12),
          instead="_NoopSaveInputs.setup_context's ctx.get_args (before 2.12)"),
    Piece("torch.utils.checkpoint:_CheckpointFrame.get_inputs", "rehearsal/device.py", since=(2, 12),
          instead="_NoopSaveInputs.setup_context's ctx.get_args (before 2.12)"),
    Piece("torch.utils.checkpoint:_NoopSaveInputs.setup_context", "rehearsal/device.py", until=(2, 12),
          instead="_CheckpointFrame.save_inputs/get_inputs (2.12 on)"),
    # torch.compile's runtime wrapper, read for whether compiled code moves the versions of the arguments it
    # writes into (compiled_writes_move_versions)
    Piece("torch._functorch._aot_autograd.runtime_wrappers:_create_runtime_wrapper", "capture/numerics/collector.py"),
    # what dynamo asks of torch.cuda.Event/Stream, which the rehearsal replaces (rehearsal/cuda.py)
    Piece("torch._streambase:_EventBase", "rehearsal/cuda.py (2.4, 2.5: dynamo asserts the Event derives from it)"),
    Piece("torch._streambase:_StreamBase", "rehearsal/cuda.py (2.4, 2.5: dynamo asserts the Stream derives from it)"),
    # the CUDA allocator's history, snapshots and OOM observer (capture/cuda_memory.py, rehearsal/memory.py)
    Piece("torch.cuda.memory:_record_memory_history", "capture/cuda_memory.py, rehearsal/memory.py"),
    Piece("torch.cuda.memory:_snapshot", "capture/cuda_memory.py, rehearsal/memory.py"),
    Piece("torch.cuda.memory:_dump_snapshot", "rehearsal/memory.py, capture/cuda_standins.py"),
    Piece("torch._C:_cuda_attach_out_of_memory_observer", "capture/cuda_memory.py (CUDA builds only)"),
    # the DataLoader's batch fetchers, timed in its forked workers (capture/probes/data.py)
    Piece("torch.utils.data._utils.fetch:_MapDatasetFetcher.fetch", "capture/probes/data.py"),
    Piece("torch.utils.data._utils.fetch:_IterableDatasetFetcher.fetch", "capture/probes/data.py"),
    # torch.profiler's once-only warnings (capture/child.py)
    Piece("torch.profiler.profiler:_WARNINGS_SHOWN", "capture/child.py", since=(2, 10),
          instead="nothing: the profiler before 2.10 has no cycle warning to mark as shown"),
)

# The attribute torch._dynamo.assume_constant_result sets on a function: dynamo then runs a traced call
# to it for real, once, and takes its result as a constant. Set directly, without importing dynamo
# (~2 s), on the auditor's functions that must run while dynamo traces (capture/unseen.py,
# rehearsal/device.py).
DYNAMO_CONSTANT = "_dynamo_marked_constant"

# The keywords the audit passes to `torch.cuda.memory._record_memory_history` (capture/cuda_memory.py).
RECORD_MEMORY_HISTORY_KEYWORDS = ("enabled", "context", "stacks", "max_entries")


def version(v: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.11.0+cu130" -> (2, 11)); torch's own by default."""
    if v is None:
        import torch

        v = str(torch.__version__)
    m = re.match(r"(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def lookup(path: str) -> Any:
    """The object at `module:attr.attr`, or None where the module or an attribute is absent."""
    module_name, _, attrs = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    for name in attrs.split(".") if attrs else ():
        # (a class's own __dict__ first: a staticmethod is read as itself, not as its function)
        obj = vars(obj).get(name, getattr(obj, name, None)) if isinstance(obj, type) else getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def installed_version() -> str | None:
    """The installed torch's version from its package metadata (without importing torch), or None."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def unsupported(v: str | None) -> str | None:
    """One line saying why torch `v` cannot be audited (older than the floor), or None."""
    if v is not None and version(v) < FLOOR:
        return (f"torch {v} is older than the oldest the auditor supports ({FLOOR[0]}.{FLOOR[1]}): "
                f"install torch>={FLOOR[0]}.{FLOOR[1]}")
    return None


class Unsupported(Exception):
    """A part of the audit this torch lacks a piece for: one line, exit 2 (a usage error)."""


# What the CUDA rehearsal cannot run without (every build of 2.4 on has them; a custom or stripped
# build may not).
REHEARSAL_NEEDS = ("torch._C:TensorBase", "torch._C._nn:_parse_to", "torch.overrides:_get_current_function_mode_stack",
                   "torch.utils._device:DeviceContext", "torch._utils:_get_obj_state",
                   "torch.utils.checkpoint:_CheckpointFrame")


def check_rehearsal() -> None:
    """Raise Unsupported naming what the CUDA rehearsal needs and this torch lacks."""
    missing = [p for p in REHEARSAL_NEEDS if lookup(p) is None]
    if missing:
        raise Unsupported(f"torch {'.'.join(map(str, version()))} ({installed_version() or 'unknown build'}) has no "
                          f"{', '.join(p.replace(':', '.') for p in missing)}: the CUDA rehearsal (a CUDA program on a "
                          "machine without a GPU) cannot run on it; run it on a GPU, or install another torch build")


# --- activation checkpointing's saved inputs -----------------------------------------------------

def checkpoint_frame() -> type | None:
    """torch.utils.checkpoint's non-reentrant frame class (`use_reentrant=False`)."""
    return lookup("torch.utils.checkpoint:_CheckpointFrame")


def keep_checkpoint_input_marks(is_marked: Callable[[Any], bool], mark: Callable[[Any], None]) -> None:
    """Non-reentrant checkpoint inputs come back from their saved tensors as new tensor objects: put
    back what `is_marked` said of each when it was saved, by position, before the recompute sees it.
    2.12 on: the frame's `save_inputs` / `get_inputs`. Before: `_NoopSaveInputs`, whose
    `setup_context` saves `(dummy, kwargs, *args)` and leaves `ctx.get_args(saved)` to give back
    `[kwargs, *args]`, which the recompute is called with."""
    frame_cls = checkpoint_frame()
    if frame_cls is not None and "save_inputs" in vars(frame_cls) and "get_inputs" in vars(frame_cls):
        orig_save, orig_get = frame_cls.save_inputs, frame_cls.get_inputs
        if hasattr(orig_get, "__wrapped__"):
            return

        def save_inputs(self: Any, *args: Any) -> None:
            self._auditor_marked = [is_marked(a) for a in args]
            orig_save(self, *args)

        def get_inputs(self: Any) -> list:
            args = orig_get(self)
            for a, marked in zip(args, getattr(self, "_auditor_marked", ())):
                if marked:
                    mark(a)
            return args

        get_inputs.__wrapped__ = orig_get  # type: ignore[attr-defined]
        frame_cls.save_inputs, frame_cls.get_inputs = save_inputs, get_inputs
        return
    saver = lookup("torch.utils.checkpoint:_NoopSaveInputs")
    setup = vars(saver).get("setup_context") if saver is not None else None
    orig_setup = setup.__func__ if isinstance(setup, staticmethod) else setup  # (a staticmethod has __wrapped__)
    if orig_setup is None or hasattr(orig_setup, "__wrapped__"):
        return

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        orig_setup(ctx, inputs, output)
        marked = [is_marked(a) for a in inputs[1:]]  # (the dummy first: get_args leaves it out)
        if any(marked):
            orig_get_args = ctx.get_args

            def get_args(saved_tensors: Any) -> list:
                args = orig_get_args(saved_tensors)
                for a, was_marked in zip(args, marked):
                    if was_marked:
                        mark(a)
                return args

            ctx.get_args = get_args

    setup_context.__wrapped__ = orig_setup  # type: ignore[attr-defined]
    saver.setup_context = staticmethod(setup_context)


# --- torch.compile's writes into its arguments ---------------------------------------------------

_WRITES_MOVE_VERSIONS: list[bool] = []


def compiled_writes_move_versions() -> bool:
    """Whether compiled code that writes into a tensor argument (`h.mul_(s)` in a compiled function)
    moves that tensor's version counter, as the same write run eagerly does. AOTAutograd keeps such
    a write inside the compiled graph, whose kernel writes the argument's memory; its runtime
    wrapper then moves the argument's version (`torch.autograd.graph.increment_version`) on the
    torches whose wrapper calls it (2.11 on, at least), not on 2.4's: there the write leaves
    `t._version` as it was. Read once from the wrapper's source (imported by torch.compile's first
    call); a torch whose source cannot be read is taken to move them."""
    if not _WRITES_MOVE_VERSIONS:
        import inspect

        module = lookup("torch._functorch._aot_autograd.runtime_wrappers")
        try:
            source = inspect.getsource(module) if module is not None else None
        except (OSError, TypeError):
            source = None
        _WRITES_MOVE_VERSIONS.append(source is None or "increment_version" in source)
    return _WRITES_MOVE_VERSIONS[0]


# --- torch.cuda.Event / Stream stand-ins ---------------------------------------------------------

def register_cuda_standins(event_cls: type, stream_cls: type) -> None:
    """Make the rehearsal's stand-in Event and Stream pass what torch's own code asks of
    torch.cuda.Event / Stream: dynamo (2.4, 2.5) asserts, as it is imported, that they derive from
    `torch._streambase._EventBase` / `_StreamBase`, abstract classes there: the stand-ins are
    registered as their virtual subclasses. From 2.6 those are deprecated subclasses of the C types
    torch.Event / torch.Stream, which nothing asserts on: nothing to register."""
    bases = lookup("torch._streambase")
    for base_name, cls in (("_EventBase", event_cls), ("_StreamBase", stream_cls)):
        base = getattr(bases, base_name, None)
        if isinstance(base, abc.ABCMeta):
            base.register(cls)


# --- torch.profiler's once-only warnings ---------------------------------------------------------

# torch.profiler warns, once per process, when a profile prepares a second cycle without acc_events:
# "Warning: Profiler clears events at the end of each cycle. Only events from the current cycle will
# be reported. To keep events across cycles, set acc_events=True." -- with no spaces after the
# periods on 2.10-2.12 (the literal's parts were joined without them), with them on 2.13 on, absent
# before 2.10. The exact text is read from torch's own source, matched with any spacing.
_CYCLE_WARNING = re.compile(r"\s*Profiler clears events at the end of each cycle\.\s*Only events from the current "
                            r"cycle will be reported\.\s*To keep events across cycles")


def profiler_warning_texts(pattern: re.Pattern[str] = _CYCLE_WARNING) -> list[str]:
    """The string literals of torch/profiler/profiler.py that `pattern` finds (searched anywhere in
    each; implicit concatenations are one literal), as torch passes them to its `_warn_once`. Read
    from the compiled module's constants, each found once per process: the window's start runs on
    the program's thread, where an ast walk of the file was 60,000 calls for a trace function of
    the program's (sys.settrace) to see."""
    key = pattern.pattern
    if key not in _WARNING_TEXTS:
        _WARNING_TEXTS[key] = _literals(pattern)
    return list(_WARNING_TEXTS[key])


_WARNING_TEXTS: dict[str, list[str]] = {}


def _literals(pattern: re.Pattern[str]) -> list[str]:
    module = lookup("torch.profiler.profiler")
    path = getattr(module, "__file__", None) if module is not None else None
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        code = compile(source, path, "exec", dont_inherit=True)
    except (OSError, TypeError, ValueError, SyntaxError):
        return []
    if "_warn_once" not in source:
        return []
    out, todo = [], [code]
    while todo:  # (a loop, not a recursion: no call a tracer would see per code object)
        for const in todo.pop().co_consts:
            if isinstance(const, str):
                if pattern.search(const):
                    out.append(const)
            elif isinstance(const, (tuple, frozenset)):
                for c in const:
                    if isinstance(c, str) and pattern.search(c):
                        out.append(c)
            elif hasattr(const, "co_consts"):
                todo.append(const)
    return out


def mark_profiler_warnings_shown() -> None:
    """Mark the cycle warning as shown in torch.profiler's once-only registry (where it has one)."""
    shown = lookup("torch.profiler.profiler:_WARNINGS_SHOWN")
    if isinstance(shown, set):
        shown.update(profiler_warning_texts())
