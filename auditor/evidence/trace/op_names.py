"""Operator names the trace's readers group by: the kinds the efficiency model has a formula for
(auditor.evidence.trace.efficiency), and the operators whose argument records (shapes, dtypes,
strides, concrete inputs) the parse keeps (auditor.evidence.trace.arg_records)."""
from __future__ import annotations

_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
           "aten::_addmm_activation"}
_CONV = {"aten::convolution", "aten::_convolution", "aten::cudnn_convolution", "aten::conv2d", "aten::conv1d",
         "aten::conv3d", "aten::miopen_convolution", "aten::convolution_backward",
         "aten::cudnn_convolution_backward"}
_ATTENTION = {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
              "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
              "aten::_scaled_dot_product_flash_attention_backward",
              "aten::_scaled_dot_product_efficient_attention_backward",
              "aten::_scaled_dot_product_cudnn_attention_backward"}
# Recurrent layers whose matmuls run inside one operator (cuDNN, MIOpen, oneDNN); aten::lstm and
# its kin are left out: on other paths the matmuls below them are operators of their own.
_RNN = {"aten::_cudnn_rnn", "aten::_cudnn_rnn_backward", "aten::miopen_rnn", "aten::miopen_rnn_backward",
        "aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward"}
_SOFTMAX = {"aten::softmax", "aten::_softmax", "aten::_softmax_backward_data", "aten::log_softmax",
            "aten::_log_softmax"}
_NORM = {"aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::native_batch_norm",
         "aten::native_batch_norm_backward", "aten::cudnn_batch_norm", "aten::cudnn_batch_norm_backward",
         "aten::native_group_norm", "aten::native_group_norm_backward", "aten::_fused_rms_norm",
         "aten::_batch_norm_impl_index", "aten::miopen_batch_norm"}
_ELEMENTWISE = {f"aten::{n}{s}" for n in ("add", "sub", "mul", "div", "gelu", "relu", "silu", "sigmoid", "tanh",
                                           "exp", "pow", "sqrt", "rsqrt", "neg", "clamp", "where", "threshold_backward",
                                           "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
                                           "masked_fill", "dropout", "native_dropout", "addcmul", "addcdiv", "lerp")
                for s in ("", "_")}
MODELLED = _MATMUL | _CONV | _ATTENTION | _RNN | _SOFTMAX | _NORM | _ELEMENTWISE

# Operators whose argument records the parse keeps: every modelled one, and those an attention
# chain holds between its matmuls (the mask's comparison and fill, dtype casts, dropout).
RECORDED_OPS = frozenset(MODELLED | {
    "aten::_to_copy", "aten::to", "aten::eq", "aten::ne", "aten::lt", "aten::gt", "aten::logical_not",
    "aten::_masked_softmax", "aten::_fused_dropout", "aten::bernoulli_", "aten::_scaled_dot_product_attention_math",
    "aten::cudnn_convolution", "aten::miopen_convolution"})
