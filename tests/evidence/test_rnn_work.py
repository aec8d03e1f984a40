"""Recurrent layers in a recording: their matmuls run inside one operator (cuDNN's _cudnn_rnn,
MIOpen's miopen_rnn, oneDNN's mkldnn_rnn_layer), which the efficiency model and amp-opportunity's
estimate had no formula for, and cuDNN's persistent RNN kernels were not read as matmul kernels.
The recording here is real: torch.profiler with record_shapes around an nn.LSTM's forward and
backward on this CPU (oneDNN's path); FLOPs recomputed by the hand formula."""
from __future__ import annotations

import json

import msgspec
import torch
from torch import nn

from auditor.evidence.trace.arg_records import raw_keys, record
from auditor.evidence.trace.efficiency import op_shapes, op_work
from auditor.evidence.trace.load import load_trace
from auditor.rules.amp_opportunity import kernel_precision

I, H, T, B, LAYERS = 8, 16, 5, 3, 2


def _recorded_lstm(path):
    torch.manual_seed(0)
    lstm = nn.LSTM(I, H, num_layers=LAYERS, bidirectional=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        lstm(torch.randn(T, B, I))[0].sum().backward()
    prof.export_chrome_trace(str(path))
    return load_trace(path)


def test_recorded_rnn_layers_have_their_matmul_flops(tmp_path):
    trace = _recorded_lstm(tmp_path / "lstm.json")
    names = trace.col("name")
    shapes = op_shapes(trace)
    work: dict[str, float] = {}
    for row, (dims, types, concrete) in shapes.items():
        name = trace.symbols[int(names[row])]
        if "rnn" in name:
            w = op_work(name, dims, types, concrete)
            assert w is not None, (name, dims)
            work[name] = work.get(name, 0.0) + w[0]
    # by hand: per time step and sequence, 2 FLOPs an element of each layer and direction's
    # w_ih (4H x input) and w_hh (4H x H); layer 1 reads both directions' outputs (2H)
    forward = T * B * 2 * 2 * (4 * H * I + 4 * H * H) + T * B * 2 * 2 * (4 * H * 2 * H + 4 * H * H)
    assert work == {"aten::mkldnn_rnn_layer": forward, "aten::mkldnn_rnn_layer_backward": 2 * forward}


def test_a_recorded_tensor_list_keeps_its_shapes(tmp_path):
    """aten::lstm records its weights as one TensorList input (the form _cudnn_rnn's `weight` and
    miopen_rnn's take): the record keeps the list's shapes, and the cuDNN formula reads them."""
    _recorded_lstm(tmp_path / "lstm.json")
    [args] = [e["args"] for e in json.loads((tmp_path / "lstm.json").read_text())["traceEvents"]
              if e.get("name") == "aten::lstm"]
    rec = record(raw_keys([msgspec.Raw(json.dumps(args).encode())])[0])
    assert rec.types[1:3] == ("TensorList", "TensorList")
    params = rec.lists[2]
    assert params[:2] == ((4 * H, I), (4 * H, H)) and len(params) == LAYERS * 2 * 4  # w_ih, w_hh, b_ih, b_hh
    dims = [list(d) if d is not None else [list(s) for s in rec.lists[i]] if rec.lists[i] else []
            for i, d in enumerate(rec.dims)]
    dims = [dims[0], dims[2]]  # _cudnn_rnn(input, weight list, ...)
    flops, _, dtype = op_work("aten::_cudnn_rnn", dims, ["float", "TensorList"])
    forward = T * B * 2 * 2 * (4 * H * I + 4 * H * H) + T * B * 2 * 2 * (4 * H * 2 * H + 4 * H * H)
    assert (flops, dtype) == (forward, "float32")
    assert op_work("aten::_cudnn_rnn_backward", dims, ["float", "TensorList"])[0] == 2 * forward


def test_cudnn_rnn_kernels_by_precision():
    """Kernel names as public H100/A10/A100 profiles print them."""
    assert kernel_precision("void RNN_blockPersist_fp_LSTM<float, float, float, 1, 128>(int, int)") == "fp32"
    assert kernel_precision("void RNN_blockPersist_bp_GRU<float, float, float, 128>(int)") == "fp32"
    assert kernel_precision("void RNN_blockPersist_fp_LSTM_HMMA<__half, __half, float, 1, 128>(const") == "reduced"
    # the per-time-step elementwise cell is not matmul work
    assert kernel_precision("void elemWiseRNNcell<float, float, float, (cudnnRNNMode_t)0, "
                            "(cudnnRNNBiasMode_t)2>(int, int, int,") is None
