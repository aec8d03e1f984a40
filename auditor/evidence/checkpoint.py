"""`audit checkpoint FILE [--against CONFIG]`: safe checkpoint loading and the evidence it gives.

Safety: files are read with `torch.load(..., weights_only=True)` only; a checkpoint that needs more
(a pickled class, a lambda) is refused with one line naming the global it asks for. Nothing here
calls `add_safe_globals`. `.safetensors` files are read by a reader of that format's own (no code,
nothing unpickled); a directory is read as a Hugging Face Trainer checkpoint (weights, optimizer.pt,
scheduler.pt, trainer_state.json; never training_args.bin or rng_state*.pth).

Layouts: a plain state_dict; a bundle ({"model"|"state_dict"|..., "optimizer"|..., "scheduler"|...});
Lightning's; an optimizer state_dict alone. Others are walked generically, every tensor checked.

Evidence: `Evidence(source="checkpoint", checkpoint=CheckpointSummary(...))`
(auditor.evidence.checkpoint_summary describes each field): per tensor its section, dtype, NaN/inf
counts and largest finite |value|; optimizer param groups and state coverage; schedulers' state;
with --against, the CONFIG's values (JSON, TOML or YAML via safe_load; lr, weight_decay, momentum,
eps, betas at the top level or under an optimizer/training section, and a scheduler section).
Rules reading it: nonfinite, lr-schedule, checkpoint-health. Accepted keys and sections in full:
bench/HISTORY.md, "auditor/evidence/checkpoint.py".
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import msgspec

from auditor.evidence.callback_scores import callback_scores
from auditor.evidence.checkpoint_summary import CheckpointSummary
from auditor.evidence.errors import InputError
from auditor.evidence.model import Environment, Evidence

MODEL_KEYS = ("model", "model_state_dict", "state_dict", "net", "network", "module", "model_state")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt", "optimizer_state")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched", "scheduler_state")
CONFIG_SECTIONS = ("optimizer", "optim", "training", "train", "trainer", "hparams", "hyperparameters", "model")
CONFIG_KEYS = {"lr": "lr", "learning_rate": "lr", "weight_decay": "weight_decay", "momentum": "momentum",
               "eps": "eps", "betas": "betas"}
SCHEDULER_SECTIONS = ("scheduler", "lr_scheduler")
STATS_CHUNK = 1 << 24  # elements per pass of tensor_stats
# torch's words for a pickle that names a global it will not load ("Unsupported global: GLOBAL x",
# "Trying to load unsupported GLOBAL posix.system whose module posix is blocked")
_UNSAFE = re.compile(r"unsupported (?:global|class)[:\s]+(?:GLOBAL\s+)?([\w.<>]+)", re.IGNORECASE)


class CheckpointRefused(InputError):
    """The checkpoint needs unsafe (code-running) unpickling; we do not do that."""


def load_checkpoint(path: Path) -> Any:
    """torch.load with weights_only=True on the CPU; one-line errors for refused or broken files."""
    import pickle

    import torch

    import warnings

    try:
        with warnings.catch_warnings():  # (torch warns of pickle protocols it may not read: we say why it failed)
            warnings.simplefilter("ignore")
            try:  # mapped from disk: a multi-GB checkpoint is read chunk by chunk, not held in memory
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):  # (the legacy, non-zip format cannot be mapped)
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        m = _UNSAFE.search(text)
        if m:
            raise CheckpointRefused(
                f"{path}: refused: loading it needs full unpickling (it pickles `{m.group(1)}`), which can run "
                "code from the file; auditor only loads checkpoints with torch.load(weights_only=True)") from None
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
        why = detail.group(1).strip() if detail else (text.splitlines() or ["unpickling failed"])[0]
        raise InputError(not_a_checkpoint(path, why[:200])) from None
    except Exception as e:  # (torch's readers raise anything on a file that is not theirs: KeyError on text)
        first = (str(e).splitlines() or [""])[0][:200] if not isinstance(e, KeyError) else ""
        raise InputError(not_a_checkpoint(path, first or type(e).__name__)) from None


def not_a_checkpoint(path: Path, why: str) -> str:
    """The one line for a file torch.load could not read: what the file is instead, when that can
    be told, and what reads it. torch's own reason ("Unsupported operand 149", "EOFError") says
    nothing to someone who gave `audit checkpoint` a memory snapshot or an empty file."""
    import shlex

    what = _what_file_is(path)
    if what is None:
        return f"{path}: not a readable torch checkpoint ({why})"
    kind, reader = what
    if reader:
        return f"{path}: {kind}, not a checkpoint: `{reader} {shlex.quote(str(path))}` audits it"
    return f"{path}: not a readable torch checkpoint ({kind})"


_SNIFF_BYTES = 1 << 16
# what torch.save's legacy (non-zip) format pickles first: its magic number 0x1950a86a20f9469cfc6c
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _what_file_is(path: Path) -> tuple[str, str | None] | None:
    """(what the file is, the audit command that reads it, if one does), or None when unknown.
    Read after torch.load failed, so a checkpoint never pays for it. A pickle is looked into with
    the snapshot reader's unpickler, which refuses every global: nothing in it can run."""
    import zlib

    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError:
        return None
    if size == 0:
        return "an empty file: 0 bytes", None
    if head[:2] == b"\x1f\x8b":  # gzip: a profiler trace is the one gzip file audit reads
        try:
            head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, _SNIFF_BYTES)
        except zlib.error:
            return None
    text = head.lstrip()
    if text[:1] in (b"{", b"[") and b'"traceEvents"' in text:
        return "a PyTorch profiler trace", "audit analyze"
    if head[:1] == b"\x80":  # (a pickle's PROTO opcode; torch.save's own format is a zip archive)
        if head[2:14] == _LEGACY_MAGIC:  # torch.save's format before torch 1.6, damaged: torch's reason holds
            return None
        if _is_memory_snapshot(path, size):
            return "a CUDA memory snapshot (torch.cuda.memory._dump_snapshot)", "audit analyze"
        return "a pickle written by pickle.dump, not torch.save", None
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # (not a character cut at the end of the sample)
            return None
    if text[:1] in (b"{", b"["):
        return "a JSON file; torch.save writes a zip archive or a pickle", None
    return "a text file; torch.save writes a zip archive or a pickle", None


def _is_memory_snapshot(path: Path, size: int) -> bool:
    """A pickle of plain containers holding allocator segments: the dict of
    torch.cuda.memory._snapshot() (or, before torch 2.0, its segment list)."""
    from auditor.evidence.snapshot import _unpickle

    # read whole by the snapshot reader (pickle's Python unpickler, ~8 MB/s) to be judged: past
    # this size, not worth it for an error line
    if size > 256 << 20:
        return False
    try:
        raw = _unpickle(path)
    except InputError:  # a pickle that names a global, or a broken one: not a snapshot
        return False
    if isinstance(raw, dict):
        return isinstance(raw.get("segments"), list)
    return isinstance(raw, list) and bool(raw) and all(isinstance(s, dict) and "blocks" in s for s in raw)


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
                       "U64": "uint64"}


def load_safetensors(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors of a .safetensors file (and its `__metadata__`), mapped from disk: an 8-byte
    little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, the bytes.
    Every entry is checked against the file before a tensor is made over it."""
    import mmap
    import warnings

    import torch

    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 1 or 8 + n > size or n > 256 * 2**20:
            raise InputError(f"{path}: not a safetensors file (no valid header)")
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError):
            raise InputError(f"{path}: not a safetensors file (its header is not JSON)") from None
        if not isinstance(header, dict):
            raise InputError(f"{path}: not a safetensors file (its header is not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        data_len = size - 8 - n
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    tensors: dict[str, Any] = {}
    for name, e in header.items():
        code = e.get("dtype") if isinstance(e, dict) else None
        dtype = getattr(torch, _SAFETENSORS_DTYPES.get(code, ""), None) if isinstance(code, str) else None
        shape = e.get("shape") if isinstance(e, dict) else None
        offs = e.get("data_offsets") if isinstance(e, dict) else None
        if (dtype is None or not isinstance(shape, list) or not all(isinstance(d, int) and 0 <= d < 2**63 for d in shape)
                or not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs))):
            raise InputError(f"{path}: not a readable safetensors file (entry {name!r}: {str(e)[:120]})")
        numel = math.prod(shape)
        if numel >= 2**63 or (numel == 0 and any(d >= 2**62 for d in shape)):
            raise InputError(f"{path}: not a readable safetensors file (entry {name!r}: shape {shape} "
                             "is larger than any tensor)")
        begin, end = offs
        if not 0 <= begin <= end <= data_len or end - begin != numel * dtype.itemsize:
            raise InputError(f"{path}: not a readable safetensors file (entry {name!r} lies outside the data "
                             "or has the wrong size: the file may be truncated)")
        with warnings.catch_warnings():  # (a read-only map: nothing here writes to the tensors)
            warnings.simplefilter("ignore")
            t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=8 + n + begin) if numel else \
                torch.empty(0, dtype=dtype)
        tensors[str(name)] = t.reshape(shape)
    return tensors, {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def load_weights(path: Path) -> tuple[Any, dict[str, str]]:
    """A weights file by its format: safetensors, or torch.save (weights_only)."""
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    return load_checkpoint(path), {}


HF_WEIGHTS = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _inside(directory: Path, name: str) -> bool:
    """`name` is a relative path that stays inside `directory` (links resolved)."""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return False
    root = directory.resolve()
    return (root / name).resolve().is_relative_to(root)


def load_hf_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any], int, dict[str, list[str]], dict[str, str]]:
    """A Hugging Face Trainer checkpoint directory as a bundle {"model", "optimizer", "scheduler"},
    what trainer_state.json says, the bytes read, the files each part came from ({"model":
    [weights files], "optimizer", "scheduler", "training_log"}) and, when sharded, the shard of
    each weight (`model.<name>`): a finding about the directory is placed at the file that holds
    what it is about (code scanning needs a file, not a directory)."""
    bundle: dict[str, Any] = {}
    read: list[Path] = []
    files: dict[str, list[str]] = {}
    shard_of: dict[str, str] = {}  # a sharded checkpoint's index: tensor name -> its shard file
    weights: dict[str, Any] = {}
    for index in HF_INDEXES:
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text())["weight_map"]
                shards = sorted(set(weight_map.values()))
                shard_of = {f"model.{k}": str(path / v) for k, v in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError, OSError):
                raise InputError(f"{path / index}: not a readable weights index (no weight_map)") from None
            for shard in shards:
                try:
                    if not isinstance(shard, str) or not _inside(path, shard):
                        raise InputError(f"{path / index}: refused: it names {str(shard)[:200]!r}, outside the "
                                         "checkpoint directory (a shard is a file beside the index)")
                    if not (path / shard).is_file():
                        raise InputError(f"{path}: the index names {shard[:200]}, which is missing")
                except OSError as e:  # (a name too long for the file system, ...)
                    raise InputError(f"{path / index}: it names {shard[:80]!r}, which cannot be read "
                                     f"({e.strerror or e})") from None
                weights.update(load_weights(path / shard)[0])
                read.append(path / shard)
            break
    else:
        for name in HF_WEIGHTS:
            if (path / name).is_file():
                loaded = load_weights(path / name)[0]
                if not isinstance(loaded, dict):
                    raise InputError(f"{path / name}: not a state_dict")
                weights.update(loaded)
                read.append(path / name)
                break
    if weights:
        bundle["model"] = weights
        files["model"] = [str(p) for p in read]
    for key, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt")):
        if (path / name).is_file():
            bundle[key] = load_checkpoint(path / name)
            read.append(path / name)
            files[key] = [str(path / name)]
    state: dict[str, Any] = {}
    if (path / "trainer_state.json").is_file():
        try:
            state = json.loads((path / "trainer_state.json").read_text())
        except (ValueError, OSError) as e:
            raise InputError(f"{path / 'trainer_state.json'}: not valid JSON ({str(e)[:120]})") from None
        read.append(path / "trainer_state.json")
        files["training_log"] = [str(path / "trainer_state.json")]
    if not bundle:
        raise InputError(f"{path}: not a checkpoint directory (no {', '.join(HF_WEIGHTS[:3])} or optimizer.pt)")
    return (bundle, training_log(state if isinstance(state, dict) else {}), sum(p.stat().st_size for p in read),
            files, shard_of)


def training_log(state: dict[str, Any]) -> dict[str, Any]:
    """trainer_state.json in brief: where it stopped, and the first logged loss or grad_norm that
    was not finite (with the last finite values before it)."""
    history = [h for h in state.get("log_history") or [] if isinstance(h, dict)]
    out: dict[str, Any] = {"global_step": state.get("global_step"), "epoch": state.get("epoch"),
                           "entries": len(history)}
    last_ok: dict[str, Any] = {}
    for h in history:
        for key in ("loss", "grad_norm", "eval_loss"):
            v = h.get(key)
            if isinstance(v, (int, float)) and not math.isfinite(v):
                out["first_nonfinite"] = {"step": h.get("step"), "epoch": h.get("epoch"), "key": key,
                                          "value": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"),
                                          "learning_rate": _scalar(h.get("learning_rate")),
                                          "last_finite": dict(last_ok)}
                return out
        for key in ("loss", "grad_norm", "learning_rate"):
            if isinstance(h.get(key), (int, float)):
                last_ok[key] = h[key]
                last_ok["step"] = h.get("step")
    if history:
        out["last"] = {k: _scalar(history[-1].get(k)) for k in ("step", "loss", "grad_norm", "learning_rate")
                       if k in history[-1]}
    return out


# --- what is in it ------------------------------------------------------------------------------

def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def tensor_stats(name: str, section: str, t: Any) -> dict[str, Any]:
    """Counts of NaN/+inf/-inf, the largest finite |value| and the negatives of one tensor.

    `max_abs` is None when the tensor holds no finite value at all (every element NaN or inf):
    0.0 there would read as a tensor of zeros."""
    import torch

    out: dict[str, Any] = {"name": name, "section": section, "dtype": str(t.dtype).replace("torch.", ""),
                           "numel": int(t.numel()), "shape": list(t.shape)}
    if t.numel() == 0 or t.is_complex() or t.is_sparse or t.is_meta:  # (a meta tensor has no data)
        return out
    if not t.is_floating_point():
        return out
    nan = pos = neg = negative = zeros = 0
    max_abs = 0.0
    with torch.no_grad():
        stored = t.untyped_storage().nbytes() // t.element_size()
        if t.numel() > stored:  # a view that repeats its storage (expand: 2**60 elements over 1 value):
            # its values are the storage's, so the storage is what is reduced
            t = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (stored,))
        flat = t.detach().reshape(-1)
        # in chunks, so the temporaries stay small for a multi-GB tensor; float8 is widened
        # first (its CPU kernels have no isinf)
        for start in range(0, flat.numel(), STATS_CHUNK):
            x = flat[start:start + STATS_CHUNK]
            if x.element_size() == 1:
                x = x.float()
            nan += int(torch.isnan(x).sum())
            pos += int(torch.isposinf(x).sum())
            neg += int(torch.isneginf(x).sum())
            mag = torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype))
            max_abs = max(max_abs, float(mag.max()))
            negative += int((x < 0).sum())
            zeros += int((x == 0).sum())
    finite = nan + pos + neg < t.numel()
    out.update(nan=nan, posinf=pos, neginf=neg, max_abs=max_abs if finite else None, negative=negative, zeros=zeros)
    return out


def _walk(obj: Any, prefix: str, section: str, out: list[dict], depth: int = 0) -> None:
    if _is_tensor(obj):
        out.append(tensor_stats(prefix or "(tensor)", section, obj))
    elif isinstance(obj, dict) and depth < 12:
        for k, v in obj.items():
            _walk(v, f"{prefix}.{k}" if prefix else str(k), section, out, depth + 1)
    elif isinstance(obj, (list, tuple)) and depth < 12:
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}.{i}" if prefix else str(i), section, out, depth + 1)


def _scalar(v: Any) -> Any:
    if _is_tensor(v) and v.numel() == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (int, float, bool, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)) and len(v) <= 256 and all(
            isinstance(x, (int, float, bool, str)) or (_is_tensor(x) and x.numel() == 1) for x in v):
        return [_scalar(x) for x in v]
    if isinstance(v, dict) and len(v) <= 256 and all(isinstance(n, int) for n in v.values()):
        # a Counter (MultiStepLR's milestones: {epoch: times}) as its sorted list, when that list is
        # of the size a schedule has: {5: 10**10} would be ten billion entries
        if all(isinstance(k, int) for k in v) and all(0 <= n for n in v.values()) and sum(v.values()) <= 256:
            return sorted(k for k, n in v.items() for _ in range(n))
        return None
    return None


def _scalars(d: dict, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if k in skip:
            continue
        s = _scalar(v)
        if s is not None:
            out[str(k)] = s
    return out


def is_optimizer_state(d: Any) -> bool:
    return isinstance(d, dict) and "param_groups" in d and "state" in d


def _list(v: Any) -> list | tuple:
    """A list or tuple as it is; a value of any other type as nothing."""
    return v if isinstance(v, (list, tuple)) else []


def optimizer_summary(d: dict, name: str, tensors: list[dict]) -> dict[str, Any]:
    """An optimizer state_dict's summary. Parts of the wrong type (param_groups that is not a list,
    a group that is not a dict, state that is not a dict) count as absent."""
    raw_groups = [g for g in _list(d.get("param_groups")) if isinstance(g, dict)]
    groups = [_scalars(g, skip=("params",)) for g in raw_groups]
    listed = [p for g in raw_groups for p in _list(g.get("params"))]
    state = d.get("state") if isinstance(d.get("state"), dict) else {}
    steps = [_scalar(s.get("step")) for s in state.values() if isinstance(s, dict) and "step" in s]
    steps = [s for s in steps if isinstance(s, (int, float)) and not isinstance(s, bool)]
    for pid, s in state.items():
        if isinstance(s, dict):
            for k, v in s.items():
                if _is_tensor(v) and not (k == "step" and v.numel() == 1):
                    tensors.append(tensor_stats(f"{name}.state.{pid}.{k}", "optimizer", v))
    kinds = sorted({str(k) for s in state.values() if isinstance(s, dict) for k in s})
    return {"name": name, "param_groups": groups, "params": len(listed), "params_with_state": len(state),
            "state_keys": kinds, "step_min": min(steps) if steps else None, "step_max": max(steps) if steps else None}


def scheduler_summary(d: Any, name: str) -> dict[str, Any] | None:
    if not isinstance(d, dict):
        return None
    out = _scalars(d)
    out["name"] = name
    return out


def summarize(obj: Any, path: Path, size: int | None = None) -> dict[str, Any]:
    """The checkpoint's contents, as the plain data of a CheckpointSummary."""
    tensors: list[dict] = []
    optimizers: list[dict] = []
    schedulers: list[dict] = []
    meta: dict[str, Any] = {}
    layout = "other"
    if isinstance(obj, dict) and "state_dict" in obj and ("optimizer_states" in obj or "lr_schedulers" in obj
                                                          or "pytorch-lightning_version" in obj):
        layout = "lightning"
        _walk(obj["state_dict"], "", "model", tensors)
        for i, o in enumerate(_list(obj.get("optimizer_states"))):
            if is_optimizer_state(o):
                optimizers.append(optimizer_summary(o, f"optimizer_states.{i}", tensors))
        for i, s in enumerate(_list(obj.get("lr_schedulers"))):
            if (sm := scheduler_summary(s, f"lr_schedulers.{i}")) is not None:
                schedulers.append(sm)
        rest = {k: v for k, v in obj.items() if k not in ("state_dict", "optimizer_states", "lr_schedulers")}
    elif is_optimizer_state(obj):
        layout = "optimizer"
        optimizers.append(optimizer_summary(obj, "optimizer", tensors))
        rest = {}
    elif isinstance(obj, dict) and obj and all(_is_tensor(v) for v in obj.values()):
        layout = "state_dict"
        _walk(obj, "", "model", tensors)
        rest = {}
    elif isinstance(obj, dict):
        used = set()
        for k in MODEL_KEYS:
            if isinstance(obj.get(k), dict):
                layout = "bundle"
                _walk(obj[k], k, "model", tensors)
                used.add(k)
        for k in OPTIMIZER_KEYS:
            if is_optimizer_state(obj.get(k)):
                layout = "bundle"
                optimizers.append(optimizer_summary(obj[k], k, tensors))
                used.add(k)
        for k in SCHEDULER_KEYS:
            if (sm := scheduler_summary(obj.get(k), k)) is not None:
                schedulers.append(sm)
                used.add(k)
        rest = {k: v for k, v in obj.items() if k not in used}
    else:
        rest = {"(root)": obj}
    for k, v in rest.items():
        if _is_tensor(v) or isinstance(v, (dict, list, tuple)):
            _walk(v, str(k), "callback" if layout == "lightning" and k == "callbacks" else "other", tensors)
        elif (s := _scalar(v)) is not None:
            meta[str(k)] = s
    if layout == "lightning":
        scores = callback_scores(obj.get("callbacks"))
        for t in tensors:
            if t["name"] in scores:
                t["score"] = scores[t["name"]]
    return {"file": str(path), "bytes": path.stat().st_size if size is None else size, "layout": layout,
            "tensors": tensors,
            "optimizers": optimizers, "schedulers": schedulers, "meta": meta,
            "totals": {"tensors": len(tensors), "values": sum(t["numel"] for t in tensors)}}


# --- the config to compare with ------------------------------------------------------------------

def read_config(path: Path) -> dict[str, Any]:
    """The config file as a dict (JSON, TOML or YAML by extension; JSON/YAML tried otherwise)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read config ({e})") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"{path}: not valid {suffix.lstrip('.') or 'config'}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: the config must be a mapping of keys to values")
    return data


def normalise_config(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The accepted keys (see the module docstring) pulled out of a config, numbers as numbers."""
    out: dict[str, Any] = {}

    def take(d: dict) -> None:
        for k, v in d.items():
            key = CONFIG_KEYS.get(str(k).lower())
            if key and key not in out and v is not None and not isinstance(v, dict):
                out[key] = _number(v)

    take(data)
    for section in CONFIG_SECTIONS:
        if isinstance(data.get(section), dict):
            take(data[section])
    for section in SCHEDULER_SECTIONS:
        for holder in (data, *(data[s] for s in CONFIG_SECTIONS if isinstance(data.get(s), dict))):
            if isinstance(holder.get(section), dict) and "scheduler" not in out:
                out["scheduler"] = {str(k): _number(v) for k, v in holder[section].items() if not isinstance(v, dict)}
    if not out:
        raise InputError(f"{path}: none of the accepted keys (lr / learning_rate, weight_decay, momentum, eps, betas, "
                         "a scheduler section) at the top level or under optimizer/training/hparams")
    return out


def _number(v: Any) -> Any:
    if isinstance(v, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(v)
        except ValueError:
            return v
    if isinstance(v, list):
        return [_number(x) for x in v]
    return v


def checkpoint_evidence(path: Path, against: Path | None = None) -> Evidence:
    """Evidence of a checkpoint file (and the config it is compared with)."""
    config = normalise_config(read_config(against), against) if against is not None else None
    import torch  # after the config: a bad config fails fast

    if path.exists() and not path.is_dir() and not path.is_file():  # a FIFO blocks, /dev/zero never ends
        raise InputError(f"{path}: not a regular file or a directory, not a checkpoint")
    try:
        summary = _summary(path)
    # a checkpoint whose parts have shapes no training program writes (a key of 5000 digits, a
    # structure nested past the interpreter's limit): one line, as any unreadable checkpoint
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError) as e:
        raise InputError(not_a_checkpoint(path, f"{type(e).__name__}: {str(e)[:160]}".replace("\n", " "))) from None
    if config is not None:
        summary["config"] = config
        summary["config_file"] = str(against)
    env = Environment(torch_version=str(torch.__version__), device="cpu")
    try:
        checkpoint = msgspec.convert(summary, CheckpointSummary)
    except msgspec.ValidationError as e:
        raise InputError(not_a_checkpoint(path, f"its contents do not fit a checkpoint summary: {e}")) from None
    return Evidence(source="checkpoint", target=str(path), environment=env, checkpoint=checkpoint)


def _summary(path: Path) -> dict[str, Any]:
    """The plain data of the CheckpointSummary of a checkpoint file or directory."""
    if path.is_dir():
        bundle, log, size, files, shards = load_hf_checkpoint(path)
        summary = summarize(bundle, path, size)
        summary["layout"] = "hf-trainer"
        summary["training_log"] = log
        summary["files"] = files
        if shards:
            summary["shards"] = shards
    else:
        obj, st_meta = load_weights(path)
        summary = summarize(obj, path)
        if st_meta:
            summary["meta"].update({f"__metadata__.{k}": v for k, v in list(st_meta.items())[:32]})
    return summary
