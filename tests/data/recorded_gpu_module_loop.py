# A CUDA loop at module level profiled from inside it, no auditor: recorded on a GPU as
# tests/data/gpu_module_loop.json.gz (`python recorded_gpu_module_loop.py OUT.json`).
import sys
import torch
from torch.profiler import ProfilerActivity, profile, schedule


class OnDevice(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        x = torch.randn(16, device="cuda")  # DEVICE LINE
        y = torch.rand(1).cuda()  # DEVICE LINE
        return x, y


torch.manual_seed(0)
loader = torch.utils.data.DataLoader(OnDevice(), batch_size=32)
model = torch.nn.Linear(16, 1).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = iter(loader)
kept = []
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, record_shapes=True,
             schedule=schedule(wait=1, warmup=1, active=3),
             on_trace_ready=lambda p: p.export_chrome_trace(sys.argv[1])) as prof:
    for i in range(6):
        x, y = next(batches)
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
