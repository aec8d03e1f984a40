"""The program behind the shared `transformer_fullstep_with_history` snapshot, re-implemented to be
rehearsed: Stanford CS336's pre-norm Transformer LM as kkaitlyn111/cs336-assignment1 writes it
(cs336_basics/transformer.py: Linear, Embedding, RMSNorm, RoPE, causal multi-head attention with an
explicit mask and softmax, SwiGLU; optimizers.py: AdamW with its state made lazily in the first
step; training.py: cross_entropy_loss), driven as kkaitlyn111/cs336-a2-systems
cs336_systems/benchmark.py:run_memory_foward_fullstep (commit c1c174d, which wrote the snapshot as
memory_files/memory_ctx128_fullstep.pickle) does it: the model and optimizer are built, the batch
moved, then the history is switched on for one full step (zero_grad, forward, loss, backward, AdamW
step) and dumped.

Each tensor-producing line keeps the operation the original runs there (same op, same operands,
same order), so the rehearsal makes the requests the original's Python lines made. einops calls
are written as the torch calls they reduce to (einsum -> torch.einsum; rearrange -> view/permute,
and a copy where einops copies). No einops or jaxtyping needed.

    python cs336_transformer.py --layers 1,2 --out-dir DIR    # writes DIR/fullstep_L1.pickle, ...

The recorded run: --d-model 2560 --d-ff 10240 --heads 32 --layers 32 --vocab 10000 --batch 4
--context 128 (the "2.7b" config, fp32, theta 10000). One snapshot per entry of --layers, each from
a fresh model, as the original's profile_memory_forward_fullstep loops over its settings.
"""
from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
from torch.optim import Optimizer


class Linear(nn.Module):
    def __init__(self, in_features, out_features, device=None, dtype=None):
        super().__init__()
        std = np.sqrt(2 / (in_features + out_features))
        weights = torch.zeros([in_features, out_features])
        if not SKIP_INIT:  # (in place: no request of its own)
            weights = torch.nn.init.trunc_normal_(weights, mean=0, std=std, a=-3 * std, b=3 * std)
        self.weight = torch.nn.Parameter(weights, requires_grad=True)

    def forward(self, x):
        return torch.einsum("oi,...i->...o", self.weight, x)


class Embedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(num_embeddings, embedding_dim, device=device, dtype=torch.float32), requires_grad=True)

    def forward(self, token_ids):
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(d_model, device=device, dtype=torch.float32), requires_grad=True)
        self.d_model = d_model

    def forward(self, x):
        in_dtype = x.dtype
        x = x.to(torch.float32)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rms = torch.sqrt(norm ** 2 / self.d_model + self.eps)
        x_normed = x / rms
        result = torch.einsum("d,bsd->bsd", self.weight, x_normed)
        return result.to(in_dtype)


class SwiGLUFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w2 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w3 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x):
        t1 = self.w1(x)
        t3 = self.w3(x)
        t2 = torch.sigmoid(t1) * t1
        t4 = t2 * t3
        return self.w2(t4)


class RoPE(nn.Module):
    def __init__(self, theta, d_k, max_seq_len, device=None):
        super().__init__()
        self.d_k = d_k
        position_indices = torch.arange(max_seq_len, device=device)
        dim_indices = torch.arange(0, d_k, 2, device=device)
        freq = 1.0 / (theta ** (dim_indices.float() / d_k))
        angles = torch.outer(position_indices, freq)
        cos_sin = torch.zeros(max_seq_len, d_k // 2, 2, device=device)
        cos_sin[:, :, 0] = torch.cos(angles)
        cos_sin[:, :, 1] = torch.sin(angles)
        self.register_buffer("cos_sin_matrix", cos_sin, persistent=False)

    def forward(self, x, token_positions):
        x_pairs = x.unflatten(-1, (self.d_k // 2, 2))  # rearrange "... (split1 split2) -> ... split1 split2": a view
        cos_vals = self.cos_sin_matrix[token_positions, :, 0]
        sin_vals = self.cos_sin_matrix[token_positions, :, 1]
        cos_vals = cos_vals.unsqueeze(1)
        sin_vals = sin_vals.unsqueeze(1)
        rotated = torch.zeros_like(x_pairs)
        rotated[..., 0] = cos_vals * x_pairs[..., 0] - sin_vals * x_pairs[..., 1]
        rotated[..., 1] = sin_vals * x_pairs[..., 0] + cos_vals * x_pairs[..., 1]
        return rotated.reshape(x.shape)


def softmax(tensor, dim):
    max_vals = torch.max(tensor, dim=dim, keepdim=True)[0]
    exp_tensor = torch.exp(tensor - max_vals)
    sum_exp = torch.sum(exp_tensor, dim=dim, keepdim=True)
    return exp_tensor / sum_exp


def scaled_dot_product_attention(Q, K, V, mask=None):
    d_k = Q.shape[-1]
    attention_scores = torch.einsum("...qd,...kd->...qk", Q, K)
    attention_scores = attention_scores / np.sqrt(d_k)
    if mask is not None:
        attention_scores = attention_scores.masked_fill(mask == False, -1e9)  # noqa: E712 (as written)
    attention_weights = softmax(attention_scores, dim=-1)
    return torch.einsum("...qk,...kd->...qd", attention_weights, V)


class MultiheadSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads, max_seq_len=None, theta=None, device=None, dtype=None, apply_rope=False):
        super().__init__()
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.rope = RoPE(theta, self.d_k, max_seq_len, device=device) if theta is not None and apply_rope else None

    def forward(self, x):
        batch_size, seq_len, _ = x.shape
        Q_x = self.q_proj(x)
        K_x = self.k_proj(x)
        V_x = self.v_proj(x)
        # rearrange "b s (n_h d_k) -> b n_h s d_k": a view
        Q = Q_x.view(batch_size, seq_len, self.num_heads, self.d_k).permute(0, 2, 1, 3)
        K = K_x.view(batch_size, seq_len, self.num_heads, self.d_k).permute(0, 2, 1, 3)
        V = V_x.view(batch_size, seq_len, self.num_heads, self.d_k).permute(0, 2, 1, 3)
        if self.rope is not None:
            positions = torch.arange(seq_len, device=x.device).unsqueeze(0).expand(batch_size, -1)
            Q = self.rope(Q, positions)
            K = self.rope(K, positions)
        mask = torch.triu(torch.ones(seq_len, seq_len, device=x.device), diagonal=1).to(torch.bool)
        mask = ~mask
        mask = mask.unsqueeze(0).unsqueeze(0).expand(batch_size, self.num_heads, -1, -1)
        result = scaled_dot_product_attention(Q, K, V, mask=mask)
        # rearrange "b n_h s d_k -> b s (n_h d_k)": a copy
        result = result.permute(0, 2, 1, 3).reshape(batch_size, seq_len, -1)
        return self.output_proj(result)


class TransformerBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, max_seq_len=None, theta=None, device=None, dtype=None):
        super().__init__()
        self.ln1 = RMSNorm(d_model, eps=1e-5, device=device, dtype=dtype)
        self.attn = MultiheadSelfAttention(d_model, num_heads, max_seq_len, theta, device=device, dtype=dtype, apply_rope=True)
        self.ln2 = RMSNorm(d_model, eps=1e-5, device=device, dtype=dtype)
        self.ffn = SwiGLUFeedForward(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x):
        h = self.ln1(x)
        h = self.attn(h)
        x = x + h
        h = self.ln2(x)
        h = self.ffn(h)
        x = x + h
        return x


class TransformerLM(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, vocab_size, context_length, num_layers, theta=None, device=None, dtype=None):
        super().__init__()
        self.num_layers = num_layers
        self.token_embeddings = Embedding(vocab_size, d_model, device, dtype)
        self.layers = nn.ModuleList(TransformerBlock(d_model, num_heads, d_ff, context_length, theta, device, dtype)
                                    for _ in range(num_layers))
        self.ln_final = RMSNorm(d_model, eps=1e-5, device=device, dtype=dtype)
        self.lm_head = Linear(vocab_size, d_model, device, dtype)

    def forward(self, x):
        x = self.token_embeddings(x)
        for i in range(self.num_layers):
            x = self.layers[i](x)
        x = self.ln_final(x)
        return self.lm_head(x)


class AdamW(Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data
                lr = group["lr"]
                beta1, beta2 = group["betas"]
                eps = group["eps"]
                weight_decay = group["weight_decay"]
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                step = state["step"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
                step_size = lr / bias_correction1
                p.data.addcdiv_(exp_avg, denom, value=-step_size)
                if weight_decay != 0:
                    p.data.add_(p.data, alpha=-lr * weight_decay)
        return None


def cross_entropy_loss(inputs, targets):
    if inputs.dim() > 2:
        inputs = inputs.reshape(-1, inputs.size(-1))
        targets = targets.reshape(-1)
    inputs_max = torch.max(inputs, dim=-1, keepdim=True).values
    inputs = inputs - inputs_max
    exp_inputs = torch.exp(inputs)
    exp_inputs_sum = exp_inputs.sum(dim=-1)
    batch_indices = torch.arange(inputs.shape[0])
    target_inputs = inputs[batch_indices, targets]
    losses = torch.log(exp_inputs_sum) - target_inputs
    return losses.mean()


def run_memory_foward_fullstep(d_model, num_heads, d_ff, context_length, num_layers, batch_size, vocab_size,
                               theta, dtype, path):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = TransformerLM(d_model=d_model, d_ff=d_ff, vocab_size=vocab_size, context_length=context_length,
                          num_heads=num_heads, num_layers=num_layers, theta=theta, device=device, dtype=dtype)
    model.to(device)
    optimizer = AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, eps=1e-8, betas=(0.9, 0.95))
    batch = torch.randint(low=0, high=vocab_size, size=(batch_size, context_length))
    batch = batch.to(device)
    inputs = batch
    targets = batch
    torch.cuda.memory._record_memory_history(max_entries=1000000)
    torch.cuda.synchronize()
    optimizer.zero_grad()
    logits = model(inputs)
    loss = loss_fn(logits, targets)
    loss.backward()
    optimizer.step()
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


loss_fn = cross_entropy_loss
SKIP_INIT = False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--d-ff", type=int, default=10240)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--layers", default="32", help="comma-separated: one full step (and snapshot) per value")
    ap.add_argument("--vocab", type=int, default=10000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--theta", type=float, default=10000)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--skip-init", action="store_true",
                    help="leave the Linear weights at zeros: trunc_normal_ fills them in place, so the memory "
                         "requests are the same, and it is most of a rehearsal's time on a CPU")
    a = ap.parse_args(argv)
    global SKIP_INIT
    SKIP_INIT = a.skip_init
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")
    os.makedirs(a.out_dir, exist_ok=True)
    for n in (int(v) for v in a.layers.split(",")):
        run_memory_foward_fullstep(a.d_model, a.heads, a.d_ff, a.context, n, a.batch, a.vocab, a.theta,
                                   torch.float32, os.path.join(a.out_dir, f"fullstep_L{n}.pickle"))


if __name__ == "__main__":
    main()
