"""A training loop at module level, recorded by tests/data/plaintrace_launcher.py: the profiler
starts inside `opt.step()` (its hook), so the trace names the module's frame by that line for the
rest of the run. The `# ... LINE` comments mark the lines that make the ops."""
import torch

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Linear(8, 4).to("cpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
kept = []
for i in range(8):
    x, y = torch.randn(16, 8), torch.rand(16, 4)
    logits = model(x)  # FORWARD LINE
    loss = torch.nn.functional.mse_loss(logits, y)
    if torch.isnan(loss):  # BOOL LINE
        break
    pos = logits[y > 0.5]  # MASK LINE
    loss.backward()
    opt.step()  # STEP LINE
    opt.zero_grad()
    kept.append(pos.detach().cpu())  # CPU LINE
