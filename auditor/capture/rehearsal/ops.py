"""CUDA rehearsal, the compute side: what the program's GPU calls would run as on a GPU.

The rehearsal's mode (`device.RehearsalMode`) hands every call with an input meant for the GPU to
`observe(func, args, out, frame)` after it ran (one dict lookup a call). Recorded as probe tallies:
* `device-matmul`: a matrix multiply or convolution of GPU tensors, and the calls whose matmuls run
  below the one call the mode sees (multi-head attention, scaled_dot_product_attention, the
  recurrent layers and cells): input dtype and shape, autocast, FLOPs and the cuDNN flags then.
  Read by amp-opportunity and cudnn-benchmark.
* `param-update`: an in-place update of a parameter with a gradient made outside `Optimizer.step`
  (`p.data.add_(p.grad, alpha=-lr)`). Read by manual-update.
* `device-launch` (launches.py): every call that launches a kernel on a GPU, at the user's line,
  with its bytes and FLOPs. Read by launch-bound.
Nothing here changes a call's arguments or results.
"""
from __future__ import annotations

from types import FrameType
from typing import Any, Callable

import torch

from auditor.capture import probes
from auditor.capture.rehearsal import launches
from auditor.capture.rehearsal.device import PARAM_OF, call_site, caller_is_user
from auditor.evidence import model as m

_T = torch._C.TensorBase


def _flops_linear(args: tuple, out: Any) -> int:
    x, w = args[0], args[1]
    return 2 * x.numel() * int(w.shape[0]) if w.dim() >= 1 else 0


def _flops_matmul(args: tuple, out: Any) -> int:
    """A dense product: each output element a dot product of the inner dimension. With a sparse
    operand (torch.sparse.mm, `torch.mm(adj, x)` of a COO or CSR matrix) only its stored values
    are multiplied, each into a row (first operand) or a column (second) of the output."""
    if not isinstance(out, torch.Tensor):
        return 0
    a, b = args[0], args[1]
    if a.layout is not torch.strided:
        return 2 * a._nnz() * (int(out.shape[-1]) if out.dim() >= 2 else 1)
    if isinstance(b, torch.Tensor) and b.layout is not torch.strided:
        return 2 * b._nnz() * (out.numel() // max(1, int(out.shape[-1])) if out.dim() >= 2 else 1)
    k = int(a.shape[-1]) if a.dim() >= 1 else 1
    return 2 * out.numel() * k


def _flops_conv(args: tuple, out: Any) -> int:
    w = args[1]
    per_out = w.numel() // max(1, int(w.shape[0]))  # Cin/groups x kernel
    return 2 * out.numel() * per_out if isinstance(out, torch.Tensor) else 0


def _flops_conv_transpose(args: tuple, out: Any) -> int:
    """conv_transpose1d/2d/3d(input, weight (Cin, Cout/groups, kernel...), ...): every input element
    is multiplied into Cout/groups x kernel outputs."""
    x, w = args[0], args[1]
    return 2 * x.numel() * (w.numel() // max(1, int(w.shape[0]))) if w.dim() >= 1 else 0


def _lead(t: torch.Tensor) -> int:
    """The rows of a tensor's last dimension: the tokens a projection multiplies."""
    return t.numel() // max(1, int(t.shape[-1])) if t.dim() >= 1 else 0


def _flops_mha(args: tuple, out: Any) -> int:
    """F.multi_head_attention_forward(query (L, N, E) or (L, E), key (S, ...), value, embed_dim, ...):
    the matmuls below it, which its one torch-function call hides (the rehearsal's mode sees no call
    made inside another): the q, k and v projections into embed_dim, q @ k^T and attn @ v over all
    heads (L x S x embed_dim each), and the output projection."""
    q, k, v = args[0], args[1], args[2]
    if not isinstance(v, torch.Tensor) or len(args) < 4 or not isinstance(args[3], int) or k.dim() < 1:
        return 0
    e, lq, lk = int(args[3]), _lead(q), _lead(k)
    s = int(k.shape[0])
    proj = 2 * e * (lq * int(q.shape[-1]) + lk * int(k.shape[-1]) + _lead(v) * int(v.shape[-1]) + lq * e)
    return proj + 4 * lq * s * e


def _flops_sdpa(args: tuple, out: Any) -> int:
    """F.scaled_dot_product_attention(q (..., L, D), k (..., S, D), v (..., S, Dv)): q @ k^T and attn @ v."""
    q, k, v = args[0], args[1], args[2] if len(args) > 2 else None
    if not isinstance(v, torch.Tensor) or k.dim() < 2:
        return 0
    s = int(k.shape[-2])
    return 2 * _lead(q) * s * (int(q.shape[-1]) + int(v.shape[-1]))


def _rnn_tokens(args: tuple) -> int:
    """The (time step, sequence) pairs an RNN layer steps through: padded input (T, B, I) or
    (B, T, I) (or unbatched (T, I)): all its rows; packed (data (sum of batch_sizes, I), batch_sizes,
    ...): the data's rows."""
    return _lead(args[0]) if isinstance(args[0], torch.Tensor) else 0


def _weights(params: Any) -> int:
    """The elements of the 2-D weights among an RNN's parameters (w_ih, w_hh, and w_hr with
    proj_size, of every layer and direction; the biases are added, not multiplied)."""
    if not isinstance(params, (list, tuple)):
        return 0
    return sum(int(p.numel()) for p in params if isinstance(p, torch.Tensor) and p.dim() == 2)


def _flops_rnn(args: tuple, out: Any) -> int:
    """torch.lstm/gru/rnn_tanh/rnn_relu (nn.LSTM, nn.GRU, nn.RNN): padded (input, hx, params, ...)
    or packed (data, batch_sizes, hx, params, ...). Every time step of every sequence multiplies
    each layer and direction's input by w_ih (gates x hidden, input) and its hidden state by w_hh
    (gates x hidden, hidden; 4 gates for an LSTM, 3 for a GRU, 1 for an RNN), and with proj_size
    the LSTM's hidden state by w_hr: 2 FLOPs an element of each weight, a time step and sequence."""
    params = next((a for a in args[1:4] if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)
                   and a[0].dim() == 2), None)
    return 2 * _rnn_tokens(args) * _weights(params)


def _flops_cell(args: tuple, out: Any) -> int:
    """torch.lstm_cell/gru_cell/rnn_tanh_cell/rnn_relu_cell(input (B, I) or (I,), hx, w_ih, w_hh, ...):
    one time step, input by w_ih and hidden state by w_hh."""
    x = args[0]
    rows = _lead(x) if x.dim() >= 1 else 0
    return 2 * rows * _weights([a for a in args[2:4]])


_MATMULS: dict[Any, tuple[str, Callable[[tuple, Any], int]]] = {
    **{getattr(torch, n): (f"torch.{n} ({module})", _flops_rnn) for n, module in
       (("lstm", "nn.LSTM"), ("gru", "nn.GRU"), ("rnn_tanh", "nn.RNN"), ("rnn_relu", "nn.RNN"))},
    **{getattr(torch, n): (f"torch.{n} ({module})", _flops_cell) for n, module in
       (("lstm_cell", "nn.LSTMCell"), ("gru_cell", "nn.GRUCell"), ("rnn_tanh_cell", "nn.RNNCell"),
        ("rnn_relu_cell", "nn.RNNCell"))},
    torch.nn.functional.multi_head_attention_forward: ("F.multi_head_attention_forward", _flops_mha),
    torch._C._nn.scaled_dot_product_attention: ("F.scaled_dot_product_attention", _flops_sdpa),
    torch._C._nn.linear: ("F.linear", _flops_linear),
    _T.matmul: ("Tensor.matmul (@)", _flops_matmul),
    torch.matmul: ("torch.matmul", _flops_matmul),
    _T.mm: ("Tensor.mm", _flops_matmul),
    torch.mm: ("torch.mm", _flops_matmul),
    _T.bmm: ("Tensor.bmm", _flops_matmul),
    torch.bmm: ("torch.bmm", _flops_matmul),
    torch.conv1d: ("conv1d", _flops_conv),
    torch.conv2d: ("conv2d", _flops_conv),
    torch.conv3d: ("conv3d", _flops_conv),
    torch.conv_transpose1d: ("conv_transpose1d", _flops_conv_transpose),
    torch.conv_transpose2d: ("conv_transpose2d", _flops_conv_transpose),
    torch.conv_transpose3d: ("conv_transpose3d", _flops_conv_transpose),
}
_CONVS = frozenset(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"))
# FLOPs functions that read their own arguments (an RNN's second is its state or batch sizes)
_OWN_ARGS = frozenset((_flops_rnn, _flops_cell))

# In-place tensor methods an update loop writes with
_UPDATES = frozenset(("add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_", "__iadd__", "__isub__",
                      "__imul__", "__itruediv__"))


def _matmul(func: Callable, args: tuple, out: Any, frame: FrameType | None) -> None:
    rec = probes.REC
    if rec is None or not rec.active or rec.in_data or len(args) < 2:
        return
    x = args[0]
    what, flops = _MATMULS[func]
    if not isinstance(x, torch.Tensor) or (flops not in _OWN_ARGS and not isinstance(args[1], torch.Tensor)):
        return
    autocast = torch.is_autocast_enabled("cpu")  # (the rehearsal's autocast("cuda") is CPU autocast)
    dtype = torch.get_autocast_dtype("cpu") if autocast else x.dtype
    conv = what in _CONVS
    data: dict[str, Any] = {"dtype": str(dtype).replace("torch.", ""), "autocast": autocast,
                            "flops": int(flops(args, out)), "conv": conv,
                            "grad": launches.recorded_for_backward(out)}
    if conv:
        data["shape"] = list(x.shape)
        data["benchmark"] = bool(torch.backends.cudnn.benchmark)
        data["tf32"] = bool(torch.backends.cudnn.allow_tf32)
    else:
        data["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    rec.add(m.DEVICE_MATMUL, what, call_site(frame), 0.0, **{k: (tuple(v) if isinstance(v, list) else v)
                                                           for k, v in data.items()})


def _data_of(func: Callable, args: tuple, out: Any, frame: FrameType | None) -> None:
    """`p.data` of a parameter: the alias remembers its parameter (see PARAM_OF)."""
    p = args[0] if args else None
    if isinstance(p, torch.nn.Parameter) and isinstance(out, torch.Tensor) and out is not p:
        out.__dict__[PARAM_OF] = p


def _in_optimizer_step(frame: FrameType | None) -> bool:
    f, depth = frame, 0
    while f is not None and depth < 30:
        if f.f_code.co_name == "step" and isinstance(f.f_locals.get("self"), torch.optim.Optimizer):
            return True
        f, depth = f.f_back, depth + 1
    return False


def _update(func: Callable, args: tuple, out: Any, frame: FrameType | None) -> None:
    rec = probes.REC
    if rec is None or not rec.active or rec.in_data or not args:
        return
    t = args[0]
    param = t if isinstance(t, torch.nn.Parameter) else t.__dict__.get(PARAM_OF) if isinstance(t, torch.Tensor) else None
    if param is None or param.grad is None or not caller_is_user(frame) or _in_optimizer_step(frame):
        return
    name = getattr(func, "__name__", "update")
    via = "Parameter.data" if param is not t else "Parameter"
    rec.add(m.PARAM_UPDATE, f"{via}.{name}", call_site(frame), 0.0, numel=int(param.numel()))


OBSERVED: dict[Any, Callable[[Callable, tuple, Any, FrameType | None], None]] = {
    **{f: _matmul for f in _MATMULS}, _T.data.__get__: _data_of,
    **{getattr(_T, n): _update for n in _UPDATES if hasattr(_T, n)},
}


# func -> (its OBSERVED recorder or None, the op's name if a call launches a kernel or None, its
# FLOPs function or None): resolved at a function's first call, then one lookup a call
_ENTRIES: dict[Any, tuple[Callable | None, str | None, Callable[[tuple, Any], int] | None]] = {}


def _entry(func: Callable) -> tuple[Callable | None, str | None, Callable[[tuple, Any], int] | None]:
    matmul = _MATMULS.get(func)
    entry = _ENTRIES[func] = (OBSERVED.get(func), launches.launch_name(func), matmul[1] if matmul else None)
    return entry


def observe(func: Callable, args: tuple, out: Any, frame: FrameType | None) -> None:
    """Record `func`'s call if it is one of OBSERVED, and count the kernel it launches (called by
    the mode after a GPU call ran)."""
    try:
        seen, launch, flops = _ENTRIES[func]
    except KeyError:
        seen, launch, flops = _entry(func)
    except TypeError:  # (unhashable)
        return
    if seen is not None:
        seen(func, args, out, frame)
    if launch is not None:
        launches.count(launch, args, out, frame, flops(args, out) if flops is not None and len(args) > 1
                       and isinstance(args[0], torch.Tensor)
                       and (flops in _OWN_ARGS or isinstance(args[1], torch.Tensor)) else 0)


def install() -> None:
    """Have the rehearsal's mode pass its GPU calls to `observe`."""
    from auditor.capture.rehearsal import device

    device.OBSERVE = observe
