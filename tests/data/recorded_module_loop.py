"""A training loop at module level, profiled with a schedule (with_stack=True) from inside it, as
users write it: every op called directly in the loop runs in the module's frame, which was running
when the profiler started, so the trace names it by the line it was on then (`prof.step()`).
tests/evidence/test_trace_lines_from_source.py runs it and asserts where its ops are placed; the
`# ... LINE` comments mark the lines that make them."""
import torch
from torch.profiler import ProfilerActivity, profile, schedule

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
kept = []
with profile(activities=[ProfilerActivity.CPU], with_stack=True, schedule=schedule(wait=1, warmup=1, active=2),
             on_trace_ready=lambda p: p.export_chrome_trace("loop.json")) as prof:
    for i in range(5):
        x, y = torch.randn(16, 8), torch.rand(16, 4)
        logits = model(x)
        loss = torch.nn.functional.mse_loss(logits, y)
        if torch.isnan(loss):  # BOOL LINE
            break
        pos = logits[y > 0.5]  # MASK LINE
        loss.backward()
        opt.step()
        opt.zero_grad()
        kept.append(pos.detach().cpu())  # CPU LINE
        print(f"step {i}: loss {loss.item():.4f}")  # ITEM LINE
        prof.step()  # PROFILER LINE
