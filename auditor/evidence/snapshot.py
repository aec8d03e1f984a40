"""CUDA caching-allocator snapshots (`torch.cuda.memory._snapshot()` pickles), loaded safely and typed.

A snapshot is the allocator's own account of device memory: every segment it obtained with cudaMalloc,
the blocks carved out of each, and (when `_record_memory_history` was on) a trace of every alloc,
free and cudaMalloc/cudaFree with the Python stack that caused it. That is the only evidence that
explains GPU memory after the fact, so the memory rules read it, and we can test them without a GPU.

Safety: a pickle can name any Python callable and call it while loading. A snapshot is plain dicts,
lists, tuples, strings and numbers, so `_SafeUnpickler.find_class` refuses every global; a file that
needs one is not a snapshot and is refused with one line, before anything it names is imported.

Figures the rules need (reserved, allocated, free inside segments, largest free block, per pool,
per stream, per device, and the replayed history's start and peak) are computed once here at load
time, so rules only read and compare. Nothing here imports torch.

An OOM snapshot written by `audit run` has a small JSON record beside it (`oom_snapshot.json` next to
`oom_snapshot.pickle`, see auditor.evidence.oom_record): what the allocator told the out-of-memory observer.
It is loaded as `Snapshot.oom`, because the snapshot's own history holds an "oom" entry only when
the OOM happened while a history was being recorded.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any, Iterable

import msgspec

from auditor.evidence.allocator.config import AllocatorConfig, from_settings
from auditor.evidence.errors import InputError
from auditor.evidence.oom_record import OOM_RECORD_KIND, oom_record_path
from auditor.evidence.recorded_frames import is_library_file
from auditor.evidence.snapshot_sizes import sane

MiB = 1 << 20
GiB = 1 << 30

ALLOCATED = "active_allocated"
# A freed block whose memory another stream may still use (record_stream): still occupied.
# torch names it "active_pending_free" in the snapshot and "active_awaiting_free" in its docs.
PENDING_FREE = frozenset({"active_pending_free", "active_awaiting_free"})
INACTIVE = "inactive"

# Trace actions, as the allocator writes them. Anything else (e.g. newer "annotate",
# "user_metadata", "compile_context" records) is kept as-is and ignored by the replay.
ALLOC, FREE_REQUESTED, FREE_COMPLETED = "alloc", "free_requested", "free_completed"
SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP = "segment_alloc", "segment_free", "segment_map", "segment_unmap"
SNAPSHOT, OOM = "snapshot", "oom"
KNOWN_ACTIONS = frozenset({ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE,
                           SEGMENT_MAP, SEGMENT_UNMAP, SNAPSHOT, OOM})
_RESERVE = frozenset({SEGMENT_ALLOC, SEGMENT_MAP})
_RELEASE = frozenset({SEGMENT_FREE, SEGMENT_UNMAP})


class StackFrame(msgspec.Struct, frozen=True):
    """One frame of a recorded stack, innermost first as torch writes them (C++ and Python mixed)."""

    name: str
    filename: str
    line: int


class Block(msgspec.Struct):
    """A piece of a segment: handed to a tensor (`active_allocated`), freed but still in use by
    another stream (`active_pending_free`), or free for reuse (`inactive`)."""

    address: int
    size: int  # bytes the block occupies (the request rounded up)
    requested_size: int  # bytes the caller asked for
    state: str
    frames: tuple[StackFrame, ...] = ()
    owner: StackFrame | None = None  # derived: the user's line that allocated it (see user_frame)

    @property
    def allocated(self) -> bool:
        return self.state == ALLOCATED

    @property
    def live(self) -> bool:
        """Occupied: allocated, or freed but waiting for another stream."""
        return self.state == ALLOCATED or self.state in PENDING_FREE

    @property
    def free(self) -> bool:
        return self.state == INACTIVE


class Segment(msgspec.Struct):
    """Memory the allocator got from one cudaMalloc (or, with expandable segments, a mapped range).
    Reserved memory is the sum of segments; a segment is returned to CUDA only when all of it is free."""

    device: int
    address: int
    total_size: int
    allocated_size: int
    active_size: int
    requested_size: int
    stream: int
    segment_type: str  # "small" (blocks <= 1 MiB, 2 MiB segments) or "large"
    pool_id: tuple[int, int] | None = None  # (0, 0): the default pool; others: CUDA graphs, MemPool
    is_expandable: bool = False
    frames: tuple[StackFrame, ...] = ()
    blocks: list[Block] = []
    # derived
    free_size: int = 0  # bytes in inactive blocks
    largest_free: int = 0  # the biggest inactive block: the biggest request this segment can serve


class TraceEntry(msgspec.Struct):
    """One allocator action from the recorded history (`device_traces[device][i]`)."""

    action: str
    addr: int | None = None  # absent for "oom"
    size: int = 0  # requested bytes for alloc/free, segment bytes for segment_*
    stream: int = 0
    time_us: int | None = None
    device_free: int | None = None  # "oom" only: what CUDA still reported free on the device
    pool_id: tuple[int, int] | None = None
    frames: tuple[StackFrame, ...] = ()
    owner: StackFrame | None = None  # derived: the user's line behind the action
    # newer torch (2.5+): the compiled region and the user's `_record_memory_history` metadata in force
    compile_context: str = ""
    user_metadata: str = ""


class AllocatorSettings(msgspec.Struct):
    """The caching allocator's configuration when the snapshot was taken (torch >= 2.5 writes it)."""

    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF as the process saw it
    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: unlimited (the default)
    garbage_collection_threshold: float = 0.0
    config: AllocatorConfig = msgspec.field(default_factory=AllocatorConfig)  # what the simulator replays under


class Annotation(msgspec.Struct, frozen=True):
    """One of the snapshot's `external_annotations`: a `record_function` range's start or end as the
    allocator's history recorded it (torch writes `Optimizer.step#Adam.step` END at each step's end)."""

    stage: str = ""  # "START" | "END"
    name: str = ""
    device: int | None = None
    time_us: int | None = None


class Usage(msgspec.Struct):
    """Byte counts over a set of segments. free = reserved - active = bytes in inactive blocks."""

    segments: int = 0
    reserved: int = 0
    allocated: int = 0  # bytes in active_allocated blocks (rounded sizes, as torch.cuda.memory_allocated)
    active: int = 0  # allocated + pending free
    requested: int = 0  # what callers asked for (allocated minus rounding)
    free: int = 0
    free_blocks: int = 0
    largest_free: int = 0
    empty_segments: int = 0  # segments with nothing active: cache that empty_cache/OOM-retry can release
    free_in_empty_segments: int = 0
    split_segments: int = 0  # segments holding both live and free blocks
    free_in_split_segments: int = 0  # holes between live blocks: cannot be returned to CUDA at all


class MemoryFigures(Usage):
    """Usage of one device (or all), broken down by pool ("small"/"large") and by stream."""

    by_pool: dict[str, Usage] = {}
    by_stream: dict[int, Usage] = {}


class History(msgspec.Struct):
    """The recorded trace of one device, replayed once at load.

    Bytes are requested sizes, as the trace records them (torch's memory_viz plots the same).
    Indices point into `Snapshot.device_traces[device]`; -1 means "when recording began".
    """

    device: int
    entries: int
    actions: dict[str, int]
    start_allocated: int  # live when recording began (allocated earlier: stacks unknown)
    start_reserved: int
    end_allocated: int
    end_reserved: int
    peak_allocated: int
    peak_allocated_index: int
    peak_reserved: int
    peak_reserved_index: int
    oom_indices: list[int] = []
    first_time_us: int | None = None
    last_time_us: int | None = None


class LiveAllocation(msgspec.Struct, frozen=True):
    """An allocation alive at some moment of a replayed history."""

    addr: int
    size: int
    stream: int
    since: int  # trace index of its alloc; -1: allocated before recording began
    frames: tuple[StackFrame, ...] = ()
    owner: StackFrame | None = None


class Owner(msgspec.Struct, frozen=True):
    """Live bytes grouped by the user line that allocated them (frame None: unknown)."""

    frame: StackFrame | None
    bytes: int
    count: int


class OomRecord(msgspec.Struct):
    """What the allocator told the out-of-memory observer (auditor.evidence.oom_record) when it gave
    up: the request, the device's total (or per-process limit) and what CUDA still had free, with
    the Python stack of the failing allocation. Read from the JSON record beside an OOM snapshot."""

    device: int
    requested: int  # bytes the allocator asked cudaMalloc for: torch's "Tried to allocate"
    device_free: int  # what CUDA reported free on the device
    device_total: int | None = None  # the device's memory, or the set_per_process_memory_fraction limit
    time_us: int | None = None  # wall clock, microseconds since the epoch
    ooms: int = 1  # how many OOMs the observer had seen in the run, this one included
    frames: tuple[StackFrame, ...] = ()  # Python stack of the failing allocation, innermost first
    owner: StackFrame | None = None  # derived: the user's line that asked (see user_frame)
    path: str = ""


class Snapshot(msgspec.Struct):
    """A loaded snapshot. `segments`, `device_traces`, `allocator_settings` mirror the pickle;
    `totals`, `devices` and `histories` are derived at load; `oom` comes from the OOM observer's
    record beside the file, when there is one."""

    path: str
    segments: list[Segment]
    device_traces: list[list[TraceEntry]]
    allocator_settings: AllocatorSettings | None = None
    external_annotations: list[Annotation] = []
    notes: list[str] = []  # format quirks met while loading (older formats, unknown actions)
    oom: OomRecord | None = None
    dropped: str = ""  # what was left out as impossible (see MAX_BYTES), one line; empty: nothing
    totals: MemoryFigures = msgspec.field(default_factory=MemoryFigures)
    devices: dict[int, MemoryFigures] = {}
    histories: dict[int, History] = {}

    @property
    def has_history(self) -> bool:
        return bool(self.histories)

    @property
    def expandable(self) -> bool:
        """Expandable segments were on (from the settings, or seen on a segment)."""
        if self.allocator_settings is not None and self.allocator_settings.expandable_segments:
            return True
        return any(s.is_expandable for s in self.segments)

    def device_segments(self, device: int) -> list[Segment]:
        return [s for s in self.segments if s.device == device]


# --------------------------------------------------------------------------------------------------
# Safe unpickling


class _Refused(Exception):
    """The pickle named a global; carried out of the unpickler so it is never mistaken for damage."""


class _MemoIndex(Exception):
    """The pickle stores an object under a memo index no pickle of this size can reach."""


class _SafeUnpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """Builds only plain containers and scalars. Every global (class or function) is refused, so no
    code a pickle names can run: `find_class` is the only road to a callable for REDUCE, BUILD,
    INST/OBJ/NEWOBJ and the copyreg extension opcodes.

    It is pickle's Python unpickler, whose memo is a dict: the C one sizes its memo array by the
    largest BINPUT/LONG_BINPUT index, so a 9-byte pickle naming index 2**27 took 2 GB. Its other
    work is bounded by the bytes of the file (a 3 MB snapshot loads in under half a second).
    A memo index is refused past `memo_limit` (the file's size: pickle.dump numbers the objects it
    memoizes from 0, each costing at least a byte), so no index names memory the file never held."""

    def __init__(self, file: Any, memo_limit: int | None = None) -> None:
        super().__init__(file)
        self._memo_limit = memo_limit

    def _put(self, index: int) -> None:
        if self._memo_limit is not None and index > self._memo_limit:
            raise _MemoIndex(f"a memo index of {index} in a {self._memo_limit}-byte file")
        self.memo[index] = self.stack[-1]

    def _load_binput(self) -> None:
        self._put(self.read(1)[0])

    def _load_long_binput(self) -> None:
        self._put(int.from_bytes(self.read(4), "little"))

    dispatch = {**pickle._Unpickler.dispatch,  # type: ignore[attr-defined]
                pickle.BINPUT[0]: _load_binput, pickle.LONG_BINPUT[0]: _load_long_binput}

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"the Python global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"an external object (persistent id {pid!r})")


LOADED_TO_JUDGE = 16 << 20  # bytes: a file up to this size is loaded to be judged; a larger one by its head


def _head_refusal(head: bytes, size: int) -> str | None:
    """Why a file whose first bytes are `head` cannot be a snapshot (None: it may be), so that a
    large file (over LOADED_TO_JUDGE) of something else is refused before it is read. A snapshot is a pickle of protocol
    2 to 5 (PROTO), of a dict or a list (torch 1.13's segment list), in a frame of at most the
    file's size under protocol 4 and 5 (FRAME)."""
    if not head:
        return "empty file, not a CUDA memory snapshot"
    if head[0] != 0x80:  # PROTO opcode: every pickle written with protocol >= 2 starts with it
        return "not a pickle (a CUDA memory snapshot is a pickle from torch.cuda.memory._dump_snapshot)"
    if size <= LOADED_TO_JUDGE:  # (a small file: the safe unpickler says what it holds, a global it names)
        return None
    if len(head) < 3 or not 2 <= head[1] <= 5:
        return f"not a CUDA memory snapshot (a pickle of protocol {head[1] if len(head) > 1 else '?'})"
    body = head[2:]
    if body[:1] == b"\x95":  # FRAME: its 8-byte length, then the frame's first opcode
        if len(body) < 10 or int.from_bytes(body[1:9], "little") > size:
            return "truncated or corrupt pickle (a frame longer than the file)"
        body = body[9:]
    if body[:1] not in (b"}", b"]", b"("):  # EMPTY_DICT, EMPTY_LIST, MARK: a dict or list begins
        return "not a CUDA memory snapshot (the pickle holds no dict or list)"
    return None


def _unpickle(path: Path) -> Any:
    try:
        if path.exists() and not path.is_file():  # a FIFO or a device would block or never end
            raise InputError(f"{path}: not a regular file, not a CUDA memory snapshot")
        with open(path, "rb") as f:
            why = _head_refusal(f.read(16), os.fstat(f.fileno()).st_size)
            if why is not None:
                raise InputError(f"{path}: {why}")
            f.seek(0)
            data = f.read()
    except OSError as e:
        raise InputError(f"{path}: cannot read memory snapshot ({e.strerror or e})") from None
    try:
        return _SafeUnpickler(io.BytesIO(data), memo_limit=len(data)).load()
    except _MemoIndex as e:
        raise InputError(f"{path}: not a CUDA memory snapshot: the pickle asks for {e}") from None
    except _Refused as e:
        raise InputError(f"{path}: refused to load: the pickle asks for {e} "
                         "(a memory snapshot needs none; loading it could run code)") from None
    except RecursionError:
        raise InputError(f"{path}: pickle nests too deeply to be a CUDA memory snapshot") from None
    except Exception as e:  # truncated or corrupt: EOFError, UnpicklingError, ValueError, ...
        raise InputError(f"{path}: truncated or corrupt pickle ({type(e).__name__}: {e})".replace("\n", " ")) from None


# --------------------------------------------------------------------------------------------------
# Frames


_NATIVE_SUFFIXES = (".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".cu", ".cuh", ".so")
# An installed package other than torch: a trainer framework, the fallback owner when all else is library.
_OTHER_PACKAGE = re.compile(r"[/\\](?:site|dist)-packages[/\\](?!torch[/\\])")


def is_python_frame(frame: StackFrame) -> bool:
    """Python source frames; C++ frames have line 0 or a native file name."""
    fn = frame.filename
    return frame.line > 0 and fn not in ("", "??") and not fn.endswith(_NATIVE_SUFFIXES)


_AUTOGRAD_NODE = re.compile(r"torch::autograd::(?:generated::)?(\w+)::apply\(")
AUTOGRAD_FILE = "<autograd>"  # marks a synthetic owner: memory the backward pass allocated


def _native_owner(frames: tuple[StackFrame, ...]) -> StackFrame | None:
    """An owner for stacks with no Python frame. The backward pass runs on autograd's C++ threads,
    so its allocations (gradients, saved buffers) carry no Python stack; naming the autograd node
    (e.g. BmmBackward0) still says which computation holds the memory."""
    in_engine = False
    for f in frames:
        m = _AUTOGRAD_NODE.search(f.name)
        if m:
            return StackFrame(name=f"{m.group(1)} (backward)", filename=AUTOGRAD_FILE, line=0)
        in_engine = in_engine or "torch::autograd::Engine::" in f.name
    return StackFrame(name="backward", filename=AUTOGRAD_FILE, line=0) if in_engine else None


def user_frame(frames: Iterable[StackFrame]) -> StackFrame | None:
    """The line that owns an allocation: the innermost Python frame outside torch, the standard
    library and installed packages (the same test profiler traces get); failing that (a trainer
    framework calling torch), the innermost frame of an installed package other than torch.
    None when the stack has no Python frames."""
    fallback = None
    for f in frames:
        if not is_python_frame(f):
            continue
        if not is_library_file(f.filename):
            return f
        if fallback is None and _OTHER_PACKAGE.search(f.filename):
            fallback = f
    return fallback


class _Frames:
    """Converts raw frame lists, sharing one tuple per distinct list: pickle memoizes repeated frame
    dicts, so a 20k-entry trace of ~60-frame stacks holds only hundreds of distinct frames."""

    def __init__(self) -> None:
        self._frame: dict[int, StackFrame] = {}
        self._list: dict[int, tuple[tuple[StackFrame, ...], StackFrame | None]] = {}
        self._stack: dict[tuple[int, ...], tuple[tuple[StackFrame, ...], StackFrame | None]] = {}
        self._keep: list[Any] = []  # keeps raw objects alive so their ids stay unique during the load

    def __call__(self, raw: Any) -> tuple[tuple[StackFrame, ...], StackFrame | None]:
        if not isinstance(raw, list) or not raw:
            return (), None
        hit = self._list.get(id(raw))  # the very same list object (pickle memoized it)
        if hit is None:
            key = tuple(map(id, raw))  # an equal list: same frame objects in the same order
            hit = self._stack.get(key)
            if hit is None:
                frames = tuple(self._one(f) for f in raw)
                hit = self._stack[key] = (frames, user_frame(frames) or _native_owner(frames))
            self._keep.append(raw)
            self._list[id(raw)] = hit
        return hit

    def _one(self, f: Any) -> StackFrame:
        sf = self._frame.get(id(f))
        if sf is None:
            self._keep.append(f)
            if isinstance(f, dict):
                sf = StackFrame(name=str(f.get("name", "")), filename=str(f.get("filename", "")),
                                line=_int(f.get("line"), 0))
            else:
                sf = StackFrame(name=str(f), filename="", line=0)
            self._frame[id(f)] = sf
        return sf


# --------------------------------------------------------------------------------------------------
# Conversion


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _pool(v: Any) -> tuple[int, int] | None:
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(x, int) for x in v):
        return (v[0], v[1])
    return None


def _block(raw: dict, addr: int, frames_of: _Frames, notes: set[str]) -> Block:
    size = _int(raw.get("size"), 0)
    frames_raw = raw.get("frames")
    requested = raw.get("requested_size")
    if frames_raw is None and isinstance(raw.get("history"), list) and raw["history"]:
        # torch 2.0 kept the stack and the requested size in the block's history
        notes.add("legacy block history")
        first = raw["history"][0] if isinstance(raw["history"][0], dict) else {}
        frames_raw = first.get("frames")
        requested = requested if requested is not None else first.get("real_size")
    state = raw.get("state")
    if not isinstance(state, str):
        notes.add("blocks without state")
        state = ALLOCATED if raw.get("allocated") else INACTIVE
    frames, owner = frames_of(frames_raw)
    return Block(address=_int(raw.get("address"), addr), size=size,
                 requested_size=_int(requested, size), state=state, frames=frames, owner=owner)


def _segment(raw: Any, frames_of: _Frames, notes: set[str]) -> Segment:
    if not isinstance(raw, dict):
        raise InputError("segment is not a dict")
    address = _int(raw.get("address"), 0)
    blocks: list[Block] = []
    offset = address
    raw_blocks = raw.get("blocks")
    if raw_blocks is not None and not isinstance(raw_blocks, list):
        raise InputError(f"a segment's blocks are of type {type(raw_blocks).__name__}, not a list")
    for b in raw_blocks or []:
        if isinstance(b, dict):
            blk = _block(b, offset, frames_of, notes)
            blocks.append(blk)
            offset = blk.address + blk.size
    from_blocks_total = sum(b.size for b in blocks)
    allocated = sum(b.size for b in blocks if b.allocated)
    active = sum(b.size for b in blocks if b.live)
    requested = sum(b.requested_size for b in blocks if b.allocated)
    free_sizes = [b.size for b in blocks if b.free]
    total = _int(raw.get("total_size"), from_blocks_total)
    for key in ("allocated_size", "active_size", "requested_size", "segment_type", "stream"):
        if key not in raw:
            notes.add(f"segments without {key}")
    seg_type = raw.get("segment_type")
    if seg_type not in ("small", "large"):
        seg_type = "small" if total <= 2 * MiB else "large"
    seg = Segment(device=_int(raw.get("device"), 0), address=address, total_size=total,
                  allocated_size=_int(raw.get("allocated_size"), allocated) if not blocks else allocated,
                  active_size=_int(raw.get("active_size"), active) if not blocks else active,
                  requested_size=_int(raw.get("requested_size"), requested) if not blocks else requested,
                  stream=_int(raw.get("stream"), 0), segment_type=seg_type,
                  pool_id=_pool(raw.get("segment_pool_id")), is_expandable=bool(raw.get("is_expandable", False)),
                  blocks=blocks)
    seg.frames, _ = frames_of(raw.get("frames"))
    seg.free_size = sum(free_sizes) if blocks else max(0, total - seg.active_size)
    seg.largest_free = max(free_sizes, default=0) if blocks else seg.free_size
    return seg


def _entry(raw: Any, frames_of: _Frames, notes: set[str]) -> TraceEntry | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("action"), str):
        notes.add("trace entries without an action")
        return None
    action = raw["action"]
    if action not in KNOWN_ACTIONS:
        notes.add(f"trace action {action!r}")
    frames, owner = frames_of(raw.get("frames"))
    addr = raw.get("addr")
    return TraceEntry(action=action, addr=addr if isinstance(addr, int) else None,
                      size=_int(raw.get("size"), 0), stream=_int(raw.get("stream"), 0),
                      time_us=raw.get("time_us") if isinstance(raw.get("time_us"), int) else None,
                      device_free=raw.get("device_free") if isinstance(raw.get("device_free"), int) else None,
                      pool_id=_pool(raw.get("pool_id")), frames=frames, owner=owner,
                      compile_context=_text(raw.get("compile_context")), user_metadata=_text(raw.get("user_metadata")))


def _settings(raw: Any) -> AllocatorSettings | None:
    if not isinstance(raw, dict):
        return None
    mss = raw.get("max_split_size")
    # torch reports "unlimited" as -1 (SIZE_MAX through a signed int) or as SIZE_MAX itself
    mss = mss if isinstance(mss, int) and 0 < mss < (1 << 62) else None
    gc = raw.get("garbage_collection_threshold")
    return AllocatorSettings(alloc_conf=str(raw.get("PYTORCH_CUDA_ALLOC_CONF") or ""),
                             expandable_segments=bool(raw.get("expandable_segments", False)),
                             max_split_size=mss, garbage_collection_threshold=float(gc) if isinstance(gc, (int, float)) else 0.0,
                             config=from_settings(raw))


def _annotation(raw: dict) -> Annotation:
    """The fields of an annotation this loader models, each kept only when of its type."""
    def typed(key: str, kind: type) -> Any:
        value = raw.get(key)
        return value if isinstance(value, kind) and not isinstance(value, bool) else None
    return Annotation(stage=typed("stage", str) or "", name=typed("name", str) or "",
                      device=typed("device", int), time_us=typed("time_us", int))


# --------------------------------------------------------------------------------------------------
# Derived figures


def _usage(segments: Iterable[Segment], u: Usage) -> Usage:
    for s in segments:
        u.segments += 1
        u.reserved += s.total_size
        u.allocated += s.allocated_size
        u.active += s.active_size
        u.requested += s.requested_size
        u.free += s.free_size
        u.free_blocks += sum(1 for b in s.blocks if b.free) if s.blocks else int(s.free_size > 0)
        u.largest_free = max(u.largest_free, s.largest_free)
        if s.active_size == 0:
            u.empty_segments += 1
            u.free_in_empty_segments += s.free_size
        elif s.free_size > 0:
            u.split_segments += 1
            u.free_in_split_segments += s.free_size
    return u


def figures(segments: list[Segment]) -> MemoryFigures:
    """Usage of these segments, with the per-pool and per-stream breakdown."""
    total = MemoryFigures()
    _usage(segments, total)
    pools: dict[str, list[Segment]] = {}
    streams: dict[int, list[Segment]] = {}
    for s in segments:
        pools.setdefault(s.segment_type, []).append(s)
        streams.setdefault(s.stream, []).append(s)
    total.by_pool = {k: _usage(v, Usage()) for k, v in sorted(pools.items())}
    total.by_stream = {k: _usage(v, Usage()) for k, v in sorted(streams.items())}
    return total


def _initial_live(trace: list[TraceEntry], segments: list[Segment]) -> tuple[list[LiveAllocation], dict[int, int]]:
    """Allocations alive when recording began, worked out from the final state: a free with no
    alloc before it, or a block live at the end that the trace never allocated (torch's memory_viz
    reasons the same way). Also returns addr -> index of allocs still open at the end."""
    opened: dict[int, int] = {}
    initial: list[LiveAllocation] = []
    for i, e in enumerate(trace):
        if e.action == ALLOC and e.addr is not None:
            opened[e.addr] = i
        elif e.action == FREE_COMPLETED and e.addr is not None:
            if opened.pop(e.addr, None) is None:
                initial.append(LiveAllocation(addr=e.addr, size=e.size, stream=e.stream, since=-1))
    for s in segments:
        for b in s.blocks:
            if b.live and b.address not in opened:
                initial.append(LiveAllocation(addr=b.address, size=b.requested_size, stream=s.stream,
                                              since=-1, frames=b.frames, owner=b.owner))
    return initial, opened


def replay(trace: list[TraceEntry], segments: list[Segment], device: int) -> History:
    """Walk one device's trace forward from the reconstructed start, tracking allocated bytes
    (alloc adds, free_completed removes: memory is reusable only then) and reserved bytes
    (segment_alloc/map add, segment_free/unmap remove), and note where each peaks."""
    initial, _ = _initial_live(trace, segments)
    live = {a.addr: a.size for a in initial}
    cur = sum(live.values())
    end_reserved = sum(s.total_size for s in segments)
    reserved = end_reserved  # undo the trace's segment changes to get the reserve at its start
    for e in trace:
        if e.action in _RESERVE:
            reserved -= e.size
        elif e.action in _RELEASE:
            reserved += e.size
    h = History(device=device, entries=len(trace), actions={}, start_allocated=cur, start_reserved=reserved,
                end_allocated=0, end_reserved=end_reserved, peak_allocated=cur, peak_allocated_index=-1,
                peak_reserved=reserved, peak_reserved_index=-1)
    actions: dict[str, int] = {}
    times = [e.time_us for e in trace if e.time_us is not None]
    for i, e in enumerate(trace):
        a = e.action
        actions[a] = actions.get(a, 0) + 1
        if a == ALLOC and e.addr is not None:
            cur += e.size - live.get(e.addr, 0)
            live[e.addr] = e.size
            if cur > h.peak_allocated:
                h.peak_allocated, h.peak_allocated_index = cur, i
        elif a == FREE_COMPLETED and e.addr is not None:
            cur -= live.pop(e.addr, 0)
        elif a in _RESERVE:
            reserved += e.size
            if reserved > h.peak_reserved:
                h.peak_reserved, h.peak_reserved_index = reserved, i
        elif a in _RELEASE:
            reserved -= e.size
        elif a == OOM:
            h.oom_indices.append(i)
    h.actions = dict(sorted(actions.items()))
    h.end_allocated = cur
    h.first_time_us = min(times, default=None)
    h.last_time_us = max(times, default=None)
    return h


def live_at(snapshot: Snapshot, device: int, index: int) -> list[LiveAllocation]:
    """Allocations alive just after trace entry `index` of `device` (-1: when recording began).
    Replays on demand: only the moments a rule asks about (the peak, an OOM) are materialised."""
    trace = snapshot.device_traces[device] if device < len(snapshot.device_traces) else []
    initial, _ = _initial_live(trace, snapshot.device_segments(device))
    live = {a.addr: a for a in initial}
    for i in range(min(index + 1, len(trace))):
        e = trace[i]
        if e.addr is None:
            continue
        if e.action == ALLOC:
            live[e.addr] = LiveAllocation(addr=e.addr, size=e.size, stream=e.stream, since=i,
                                          frames=e.frames, owner=e.owner)
        elif e.action == FREE_COMPLETED:
            live.pop(e.addr, None)
    return list(live.values())


def reserved_at(snapshot: Snapshot, device: int, index: int) -> int:
    """Bytes reserved just after trace entry `index` of `device` (-1: when recording began)."""
    h = snapshot.histories.get(device)
    if h is None:
        return sum(s.total_size for s in snapshot.device_segments(device))
    reserved = h.start_reserved
    for e in snapshot.device_traces[device][:index + 1]:
        if e.action in _RESERVE:
            reserved += e.size
        elif e.action in _RELEASE:
            reserved -= e.size
    return reserved


def live_requested(snapshot: Snapshot, device: int) -> int:
    """Bytes the callers asked for in the blocks occupied at the snapshot (allocated, or freed but
    awaiting another stream): the basis of the replayed history (see History) and of `owners`, so
    the snapshot's own moment can be set against the history's peak. `Usage.allocated` counts the
    blocks' rounded sizes instead, as torch.cuda.memory_allocated does; set against a replayed
    peak, that figure can read above it."""
    return sum(sum(b.requested_size for b in s.blocks if b.live) if s.blocks else s.requested_size
               for s in snapshot.device_segments(device))


def owners(allocations: Iterable[LiveAllocation | Block]) -> list[Owner]:
    """Live bytes grouped by owning user line, largest first (frame None: no stack recorded)."""
    groups: dict[StackFrame | None, list[int]] = {}
    for a in allocations:
        size = a.size if isinstance(a, LiveAllocation) else a.requested_size
        g = groups.setdefault(a.owner, [0, 0])
        g[0] += size
        g[1] += 1
    out = [Owner(frame=f, bytes=b, count=c) for f, (b, c) in groups.items()]
    out.sort(key=lambda o: (-o.bytes, o.frame is None))
    return out


# --------------------------------------------------------------------------------------------------
# The OOM observer's record

_OOM_RECORD_MAX_BYTES = 1 << 20


def _oom_record(snapshot_path: Path, frames_of: _Frames, notes: set[str]) -> OomRecord | None:
    """The observer's record beside the snapshot; None (with a note when it is damaged) without one.
    A bad record never fails the load: the snapshot stands on its own."""
    path = oom_record_path(snapshot_path)
    try:
        if not path.is_file():
            return None
        if path.stat().st_size > _OOM_RECORD_MAX_BYTES:
            notes.add(f"OOM observer record {path.name} too large, not read")
            return None
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError):
        notes.add(f"unreadable OOM observer record {path.name}")
        return None
    if not isinstance(raw, dict) or raw.get("kind") != OOM_RECORD_KIND:
        return None  # some other JSON that happens to share the name
    device, requested, free = (_int(raw.get(k), -1) for k in ("device", "requested", "device_free"))
    if min(device, requested, free) < 0:
        notes.add(f"incomplete OOM observer record {path.name}")
        return None
    total = _int(raw.get("device_total"), -1)
    frames, owner = frames_of(raw.get("frames"))
    return OomRecord(device=device, requested=requested, device_free=free,
                     device_total=total if total > 0 else None,
                     time_us=raw.get("time_us") if isinstance(raw.get("time_us"), int) else None,
                     ooms=max(1, _int(raw.get("ooms"), 1)), frames=frames, owner=owner, path=str(path))


# --------------------------------------------------------------------------------------------------
# Loading


def _check_work(raw: dict, size: int) -> None:
    """Refuse a pickle whose segments' blocks and trace entries (with their keys) outnumber the
    bytes of the file: each costs a real snapshot many bytes, but a pickle can repeat one shared
    object by a 2-byte reference, so a 12 KB file of shared lists named 9 million blocks. Counting
    stops at the limit, so the check costs no more than the file's own content."""
    limit = max(size, 1 << 16)
    n = 0

    def over() -> InputError:
        return InputError(f"not a CUDA memory snapshot: over {limit} blocks and trace entries from a "
                          f"{size}-byte file (the pickle repeats shared references)")

    for s in raw.get("segments") or []:
        blocks = s.get("blocks") if isinstance(s, dict) else None
        n += 1 + (len(blocks) if isinstance(blocks, list) else 0)
        if n > limit:
            raise over()
    traces = raw.get("device_traces")
    for t in traces if isinstance(traces, list) else []:
        for e in t if isinstance(t, list) else []:
            n += 1 + (len(e) if isinstance(e, dict) else 0)
            if n > limit:
                raise over()


def load_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Load a `torch.cuda.memory._dump_snapshot()` pickle (any protocol >= 2, torch 1.13 onwards).

    Raises InputError (one line) for a missing, empty, truncated or corrupt file, a pickle that
    names any Python global (it could run code), or a pickle that is not a memory snapshot.
    """
    p = Path(path)
    raw = _unpickle(p)
    notes: set[str] = set()
    if isinstance(raw, list):  # torch 1.13: memory_snapshot() returned the segment list alone
        notes.add("segment list without a snapshot dict")
        raw = {"segments": raw, "device_traces": []}
    if not isinstance(raw, dict) or not isinstance(raw.get("segments"), list):
        got = ("a dict without a 'segments' list" if isinstance(raw, dict) else f"a {type(raw).__name__}")
        raise InputError(f"{p}: not a CUDA memory snapshot (expected a dict with a 'segments' list, got {got})")
    try:
        _check_work(raw, p.stat().st_size)
        return _convert(p, raw, notes)
    except InputError as e:
        raise InputError(f"{p}: {e}" if str(e).startswith("not a CUDA") else
                         f"{p}: not a CUDA memory snapshot ({e})") from None
    # a value of a type or size no snapshot holds (a 5000-digit int as a name, a frame nested
    # 100k deep): one line, as for any other file that is not a snapshot
    except (TypeError, ValueError, AttributeError, OverflowError, KeyError, IndexError, RecursionError) as e:
        raise InputError(f"{p}: not a CUDA memory snapshot ({type(e).__name__}: {str(e)[:120]})"
                         .replace("\n", " ")) from None


def _convert(p: Path, raw: dict, notes: set[str]) -> Snapshot:
    frames_of = _Frames()
    dropped: list = [0, ""]  # [entries left out, the first one's reason]
    segments = [_segment(s, frames_of, notes) for s in sane(raw["segments"], "a segment", dropped)]
    traces_raw = raw.get("device_traces")
    if traces_raw is None:
        notes.add("no device_traces")
        traces_raw = []
    if not isinstance(traces_raw, list):
        raise InputError(f"device_traces is of type {type(traces_raw).__name__}, not a list")
    traces: list[list[TraceEntry]] = []
    for t in traces_raw:
        entries = [_entry(e, frames_of, notes) for e in sane(t if isinstance(t, list) else [], "a trace entry", dropped)]
        traces.append([e for e in entries if e is not None])
    settings = _settings(raw.get("allocator_settings"))
    if settings is None:
        notes.add("no allocator_settings")
    annotations_raw = raw.get("external_annotations") or []
    if not isinstance(annotations_raw, list):
        notes.add("external_annotations that are not a list (left out)")
        annotations_raw = []
    annotations = [_annotation(a) for a in annotations_raw if isinstance(a, dict)]

    oom = _oom_record(p, frames_of, notes)

    snap = Snapshot(path=str(p), segments=segments, device_traces=traces, allocator_settings=settings,
                    external_annotations=annotations, notes=sorted(notes), oom=oom)
    if dropped[0]:
        n = dropped[0]
        snap.dropped = (f"{n:,} {'entries' if n != 1 else 'entry'} with sizes no device has "
                        f"{'were' if n != 1 else 'was'} left out (the first: {dropped[1]})")
    snap.totals = figures(segments)
    device_ids = sorted({s.device for s in segments} | {i for i, t in enumerate(traces) if t})
    snap.devices = {d: figures(snap.device_segments(d)) for d in device_ids}
    snap.histories = {d: replay(traces[d], snap.device_segments(d), d)
                      for d in device_ids if d < len(traces) and traces[d]}
    return snap


def format_bytes(n: float) -> str:
    """Human figure in binary units (GiB/MiB/KiB), as torch's own memory tools print them."""
    n = float(n)
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
