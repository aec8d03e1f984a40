"""examples/demo.py's step as a loop at module level, run under a launcher that records the whole
program (`runpy.run_path` of this file, `prof.step()` in an optimizer step hook, as a whole-program
recorder does). tests/fixtures/h100/derived/plaintrace_module_loop.json.gz is derived from a real
H100 recording of demo.py's step (derive_plaintrace_module_loop.py): its ops, kernels and syncs are
that recording's, its frames this file's. The `# ... LINE` comments mark the lines that make them."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


class Images(Dataset):
    def __len__(self):
        return 2048

    def __getitem__(self, idx):  # GETITEM LINE
        g = torch.Generator().manual_seed(idx)
        img = F.avg_pool2d(torch.rand(1, 3, 72, 72, generator=g), 3, stride=1, padding=1)[0]
        img = img[:, idx % 8:idx % 8 + 64, (idx // 8) % 8:(idx // 8) % 8 + 64]
        return (img - img.mean()) / (img.std() + 1e-6), idx % 10


loader = DataLoader(Images(), batch_size=64, shuffle=True)
model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = iter(loader)
epoch_loss = 0.0
log = []
for i in range(10):
    torch.cuda.reset_peak_memory_stats()
    try:
        x, y = next(batches)  # NEXT LINE
    except StopIteration:
        batches = iter(loader)
        x, y = next(batches)  # NEXT LINE
    x, y = x.to(device), y.to(device)  # TO LINE
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()  # STEP LINE
    epoch_loss += loss
    log.append({"step": i, "loss": loss.item(), "peak": torch.cuda.max_memory_allocated()})  # ITEM LINE
