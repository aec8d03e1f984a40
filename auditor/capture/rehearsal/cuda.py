"""CUDA rehearsal, the `torch.cuda` side: the CUDA API answered as a one-GPU machine would, on the CPU.

Program code asks `torch.cuda` about the device, seeds it, makes streams and events and turns on
mixed precision; on a CPU-only torch most of that raises. Each call has a stand-in that behaves
plausibly and is recorded (`cuda-standin` tallies at the user's line):
* device queries answer as a single device, to the user's code and third-party libraries only:
  torch's own callers get the true answer, so torch keeps its CPU paths and computes what the
  program's CPU version computes;
* `synchronize()` (torch.cuda, Stream, Event) is recorded as a device sync;
* the memory-statistics family answers as an idle device (auditor.capture.cuda_standins);
* `autocast("cuda", dtype)` is CPU autocast with the same dtype, `GradScaler("cuda")` a CPU one;
* `manual_seed` and the RNG-state calls are recorded, the CPU generator left alone;
* `torch.Generator(device="cuda")` is a CPU generator marked as the GPU's, and using it with a
  tensor of the other device fails as on a GPU (auditor.capture.rehearsal.device).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from auditor.capture import cuda_standins, probes, torch_private
from auditor.capture.rehearsal.device import CUDA_MARK, REHEARSED_DEVICE, call_site, caller_is_user, is_cuda_request
from auditor.evidence import model as m

DEVICE_NAME = "CUDA device rehearsed on the CPU"
ELAPSED_TIME = "torch.cuda.Event.elapsed_time"
CAPABILITY = (8, 0)


def _record(what: str, frame: Any) -> None:
    rec = probes.REC
    if rec is not None and rec.active:
        rec.add(m.CUDA_STANDIN, what, call_site(frame), 0.0)


def _sync(what: str, frame: Any) -> None:
    """A wait for the device the program asked for (Stream/Event.synchronize): a sync to the rules."""
    rec = probes.REC
    if rec is not None and rec.active and not rec.in_data:
        rec.add(m.SYNC, what, call_site(frame), 0.0, device="cuda")


_COMPILER_DIRS = tuple(os.path.join(os.path.dirname(torch.__file__), d) + os.sep for d in ("_dynamo", "_inductor"))


# The device queries whose rehearsed answer (a GPU is there) sends a program down its GPU path
QUERIES = frozenset({"is_available", "device_count", "current_accelerator"})
# (what, file, line) of the first of them the program (or a library it calls) asked: a plain run
# told "no GPU" there takes its CPU path (auditor.capture.rehearsal.blame)
TOLD_GPU: list[tuple[str, str, int]] = []


def _standin(what: str, impl: Callable[..., Any], real: Callable[..., Any] | None = None,
             orig: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """Wrap `impl` so the user's calls are recorded; with `real`, torch's own calls get `real`.
    torch.compile's own calls get `orig` (the CPU build's function, which says there is no CUDA):
    the tensors it compiles for are on the CPU, so it must generate CPU code."""
    query = what.rsplit(".", 1)[-1] in QUERIES

    def standin(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        if caller_is_user(frame):
            _record(what, frame)
            if query and not TOLD_GPU:
                site = call_site(frame)
                TOLD_GPU.append((what, site[0], site[1]) if site else (what, "", 0))
            return impl(*args, **kwargs)
        if orig is not None and frame.f_code.co_filename.startswith(_COMPILER_DIRS):
            return orig(*args, **kwargs)
        return (real or impl)(*args, **kwargs)
    standin.__name__ = standin.__qualname__ = what.rsplit(".", 1)[-1]
    standin.__doc__ = f"Rehearsal stand-in for {what} (auditor.capture.rehearsal.cuda)."
    return standin


# --- device queries ------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceProperties:
    """What `torch.cuda.get_device_properties()` reports for the rehearsed device."""

    name: str = DEVICE_NAME
    major: int = CAPABILITY[0]
    minor: int = CAPABILITY[1]
    total_memory: int = 0
    multi_processor_count: int = os.cpu_count() or 1
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    L2_cache_size: int = 0
    warp_size: int = 32


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 16 << 30


class _DeviceContext(contextlib.AbstractContextManager):
    """`torch.cuda.device(i)` / `device_of(t)`: one device, nothing to switch."""

    def __init__(self, device: Any = None) -> None:
        self.idx = 0

    def __exit__(self, *exc: Any) -> None:
        return None


# --- streams and events --------------------------------------------------------------------------

class Stream(torch.Stream):
    """The rehearsed device's stream: the CPU runs everything in order, so waits are no-ops.
    A torch.Stream (of the CPU, underneath), as torch.cuda.Stream is one: torch's C++ functions
    that take a stream accept it (`t.record_stream(s)`, which the rehearsal then answers), where
    a plain object would fail their argument check ('unknown parameter type')."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        if caller_is_user(sys._getframe(1)):
            _record("torch.cuda.Stream", sys._getframe(1))
        self.priority = priority
        self.cuda_stream = 0

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return REHEARSED_DEVICE

    def __eq__(self, other: object) -> bool:  # each stream is its own, as CUDA streams are
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:0 cuda_stream={id(self):#x} (rehearsed on the CPU)>"

    def wait_event(self, event: "Event") -> None:
        return None

    def wait_stream(self, stream: "Stream") -> None:
        return None

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event if event is not None else Event()
        event._stamp()
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _sync("torch.cuda.Stream.synchronize", sys._getframe(1))

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class Event:
    """A CUDA event: `elapsed_time` gives the CPU time between two records, in ms."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **kwargs: Any) -> None:
        if caller_is_user(sys._getframe(1)):
            _record("torch.cuda.Event", sys._getframe(1))
        self.enable_timing = enable_timing
        self._t: float | None = None

    def _stamp(self) -> None:
        self._t = time.perf_counter()

    def record(self, stream: Stream | None = None) -> None:
        self._stamp()

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _sync("torch.cuda.Event.synchronize", sys._getframe(1))

    def elapsed_time(self, end_event: "Event") -> float:
        if caller_is_user(sys._getframe(1)):  # host-sync tells a sync made for event timing from others
            _record(ELAPSED_TIME, sys._getframe(1))
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end_event._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._t - self._t) * 1e3


_STREAM = Stream()


class StreamContext:
    """`torch.cuda.stream(s)` / `torch.cuda.StreamContext(s)`: with one stream there is nothing to
    switch. A class, as torch's is: torch.compile tests values with isinstance against it."""

    def __init__(self, stream: Stream | None = None) -> None:
        self.stream = stream

    def __enter__(self) -> Stream | None:
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        return None


# --- RNG -----------------------------------------------------------------------------------------

class _Rng:
    """The rehearsed device's seed: kept for `initial_seed()` and given to the device's default
    generator; the random numbers the program draws on the device come from the CPU's generator."""

    seed = 0
    generator: Any = None  # torch.cuda.default_generators[0], once installed

    def manual_seed(self, seed: int) -> None:
        self.seed = int(seed)
        if self.generator is not None:
            self.generator.manual_seed(self.seed)

    def new_seed(self) -> None:
        self.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def state(self, device: Any = "cuda") -> torch.Tensor:
        return torch.tensor(list(self.seed.to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8)


_RNG = _Rng()
_RealGenerator = torch.Generator


class _GeneratorMeta(type(_RealGenerator)):  # type: ignore[misc]
    """`isinstance(g, torch.Generator)` stays true of every generator, rehearsed or made before."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _RealGenerator)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _RealGenerator)


class RehearsalGenerator(_RealGenerator, metaclass=_GeneratorMeta):
    """`torch.Generator(device="cuda")`: a CPU generator (the CPU draws the numbers) marked as the
    GPU's, so calls that pair it with a host tensor fail as they would on a GPU."""

    def __new__(cls, device: Any = "cpu") -> "RehearsalGenerator":
        if not is_cuda_request(device):
            return super().__new__(cls, device)
        frame = sys._getframe(1)
        if caller_is_user(frame):
            _record("torch.Generator(cuda)", frame)
        g = super().__new__(cls, "cpu")
        setattr(g, CUDA_MARK, True)
        return g

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return REHEARSED_DEVICE if getattr(self, CUDA_MARK, False) else super().device


# --- mixed precision -----------------------------------------------------------------------------

# CPU autocast refuses the other dtypes CUDA autocast takes (float32: a trainer's `--dtype float32`)
_CPU_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
_CPU_REFUSAL = "In CPU autocast, but the target dtype is not supported"


class RehearsalAutocast(torch.amp.autocast):
    """`torch.autocast("cuda", dtype)`: CPU autocast with the dtype the GPU would use. Where CPU
    autocast refuses that dtype (float32), it is off, as CUDA autocast to float32 computes in
    float32, without the warning CPU autocast gives: a GPU run does not print it."""

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        if device_type == "cuda":
            if caller_is_user(sys._getframe(1)):
                _record("torch.autocast(cuda)", sys._getframe(1))
            # (dtype is passed on as given, not judged as a bool: torch takes any object there)
            device_type = "cpu"
            dtype = torch.get_autocast_dtype("cuda") if dtype is None else dtype
            if dtype not in _CPU_AUTOCAST_DTYPES:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=_CPU_REFUSAL)
                    super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
                return
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class RehearsalCudaAmpAutocast(RehearsalAutocast):
    """The deprecated `torch.cuda.amp.autocast(enabled, dtype, cache_enabled)`."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        super().__init__("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class RehearsalGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler("cuda")`: the CPU GradScaler, which does the same arithmetic."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        meant = device
        if device == "cuda":
            if caller_is_user(sys._getframe(1)):
                _record("torch.amp.GradScaler(cuda)", sys._getframe(1))
            device = "cpu"
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        # its found_inf reads wait for the GPU there (auditor.capture.probes judges them so)
        self._audit_device = "cuda" if str(meant).startswith("cuda") else None


class RehearsalCudaAmpGradScaler(RehearsalGradScaler):
    """The deprecated `torch.cuda.amp.GradScaler(init_scale, ...)`."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        super().__init__("cuda", init_scale, growth_factor, backoff_factor, growth_interval, enabled)


def _install_amp() -> None:
    torch.autocast = torch.amp.autocast = RehearsalAutocast  # type: ignore[misc]
    torch.amp.GradScaler = RehearsalGradScaler  # type: ignore[misc]
    import torch.cuda.amp as cuda_amp

    cuda_amp.autocast = RehearsalCudaAmpAutocast  # type: ignore[misc]
    cuda_amp.GradScaler = RehearsalCudaAmpGradScaler  # type: ignore[misc]


# --- installation --------------------------------------------------------------------------------

class _NvtxStub:
    """NVTX ranges mark a profiler timeline; with no GPU there is none to mark."""

    rangePushA = staticmethod(lambda msg: 0)
    rangePop = staticmethod(lambda: 0)
    rangeStartA = staticmethod(lambda msg: 0)
    rangeEnd = staticmethod(lambda rid: None)
    markA = staticmethod(lambda msg: None)
    deviceRangeStart = staticmethod(lambda msg, stream: 0)
    deviceRangeEnd = staticmethod(lambda rid, stream: None)


def _cuda_table(real: Any) -> dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]]:
    """name -> (answer to the user's code, answer to torch's own calls or None for the same)."""
    props = DeviceProperties(total_memory=_host_memory())
    one = lambda *a, **k: 1  # noqa: E731
    zero = lambda *a, **k: 0  # noqa: E731
    none = lambda *a, **k: None  # noqa: E731
    return {
        "is_available": (lambda: True, real.is_available),
        "device_count": (one, real.device_count),
        "is_initialized": (lambda: True, real.is_initialized),
        "current_device": (zero, None),
        "set_device": (none, None),
        "init": (none, None),
        "get_device_name": (lambda *a, **k: DEVICE_NAME, None),
        "get_device_properties": (lambda *a, **k: props, None),
        "get_device_capability": (lambda *a, **k: CAPABILITY, None),
        "get_arch_list": (lambda: [f"sm_{CAPABILITY[0]}{CAPABILITY[1]}"], None),
        "is_bf16_supported": (lambda *a, **k: True, None),
        "mem_get_info": (lambda *a, **k: (props.total_memory, props.total_memory), None),
        "set_per_process_memory_fraction": (none, None),
        "set_sync_debug_mode": (none, None),
        "get_sync_debug_mode": (zero, None),
        "utilization": (zero, None),
        "manual_seed": (_RNG.manual_seed, None),
        "manual_seed_all": (_RNG.manual_seed, None),
        "seed": (_RNG.new_seed, None),
        "seed_all": (_RNG.new_seed, None),
        "initial_seed": (lambda: _RNG.seed, None),
        "get_rng_state": (_RNG.state, None),
        "get_rng_state_all": (lambda: [_RNG.state()], None),
        "set_rng_state": (none, None),
        "set_rng_state_all": (none, None),
        "current_stream": (lambda *a, **k: _STREAM, None),
        "default_stream": (lambda *a, **k: _STREAM, None),
        "set_stream": (none, None),
        "stream": (StreamContext, None),
    }


def _accelerator_table(real: Any) -> dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]]:
    """`torch.accelerator` as on a one-GPU CUDA machine: the accelerator is `device("cuda")`, its
    stream the rehearsed device's, its memory statistics those of an idle device."""
    none = lambda *a, **k: None  # noqa: E731
    table: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]] = {
        "is_available": (lambda: True, real.is_available),
        "device_count": (lambda: 1, real.device_count),
        "current_accelerator": (lambda *a, **k: torch.device("cuda"), real.current_accelerator),
        "current_device_index": (lambda: 0, None),
        "current_device_idx": (lambda: 0, None),
        "set_device_index": (none, None),
        "set_device_idx": (none, None),
        "current_stream": (lambda *a, **k: _STREAM, None),
        "set_stream": (none, None),
        "device_index": (_DeviceContext, None),
        "get_memory_info": (lambda *a, **k: (_host_memory(), _host_memory()), None),
        "empty_host_cache": (none, None),
    }
    for name, answer in cuda_standins._answers().items():
        table.setdefault(name, (answer, None))
    return table


def _accelerator_synchronize(device: Any = None) -> None:
    """`torch.accelerator.synchronize()`: a wait for the device, a sync to the rules."""
    _sync("torch.accelerator.synchronize", sys._getframe(1))


def install() -> list[str]:
    """Replace the torch.cuda API with the stand-ins; returns the names replaced. Runs before the
    probes, which then wrap the replaced `synchronize` and memory-statistics functions."""
    replaced = cuda_standins.install(lambda: probes.REC)  # the memory family, as an idle device
    cuda = torch.cuda
    for name, (impl, real) in _cuda_table(cuda).items():
        if hasattr(cuda, name):
            setattr(cuda, name, _standin(f"torch.cuda.{name}", impl, real, getattr(cuda, name)))
            replaced.append(name)
    cuda.Stream, cuda.Event, cuda.device, cuda.device_of = Stream, Event, _DeviceContext, _DeviceContext
    torch_private.register_cuda_standins(Event, Stream)
    cuda.StreamContext = StreamContext
    replaced += ["Stream", "Event", "device", "device_of", "StreamContext"]
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        for name, (impl, real) in _accelerator_table(acc).items():
            if hasattr(acc, name):
                setattr(acc, name, _standin(f"torch.accelerator.{name}", impl, real))
        if hasattr(acc, "synchronize"):
            acc.synchronize = _accelerator_synchronize
    cuda.nvtx._nvtx = _NvtxStub()
    torch.Generator = RehearsalGenerator  # type: ignore[misc]
    replaced.append("torch.Generator")
    # the device's default generator (`torch.cuda.default_generators[0].manual_seed(s)` in seeding
    # helpers): a generator of the rehearsed device's own, which `torch.cuda.manual_seed` seeds too
    _RNG.generator = RehearsalGenerator("cuda")
    cuda.default_generators = (_RNG.generator,)
    replaced.append("default_generators")
    _install_amp()
    from auditor.capture.rehearsal import memory  # the history calls, answered from the rehearsed requests
    replaced += memory.install()
    return sorted(set(replaced))
