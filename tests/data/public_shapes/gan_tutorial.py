"""The shape of yunjey/pytorch-tutorial's generative_adversarial_network/main.py: the labels
(`torch.ones(batch_size, 1).to(device)`) and the noise (`torch.randn(batch_size, latent_size).to(device)`)
built on the host and copied to the device every step; the noise also bound first and copied a line later."""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
latent_size, hidden, image_size, batch_size = 16, 64, 64, 32
torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.rand(512, image_size) * 2 - 1), batch_size=batch_size, shuffle=True)
D = nn.Sequential(nn.Linear(image_size, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1), nn.Sigmoid()).to(device)
G = nn.Sequential(nn.Linear(latent_size, hidden), nn.ReLU(), nn.Linear(hidden, image_size), nn.Tanh()).to(device)
criterion = nn.BCELoss()
d_optimizer = torch.optim.Adam(D.parameters(), lr=0.0002)
g_optimizer = torch.optim.Adam(G.parameters(), lr=0.0002)
for epoch in range(3):
    for i, (images,) in enumerate(data):
        images = images.reshape(batch_size, -1).to(device)
        real_labels = torch.ones(batch_size, 1).to(device)  # ONES LINE
        fake_labels = torch.zeros(batch_size, 1).to(device)  # ZEROS LINE
        outputs = D(images)
        d_loss_real = criterion(outputs, real_labels)
        z = torch.randn(batch_size, latent_size).to(device)  # NOISE LINE
        fake_images = G(z)
        d_loss_fake = criterion(D(fake_images), fake_labels)
        d_loss = d_loss_real + d_loss_fake
        d_optimizer.zero_grad()
        d_loss.backward()
        d_optimizer.step()
        z = torch.randn(batch_size, latent_size)  # SPLIT LINE
        z = z.to(device)
        g_loss = criterion(D(G(z)), real_labels)
        g_optimizer.zero_grad()
        g_loss.backward()
        g_optimizer.step()
        if (i + 1) % 8 == 0:
            print(f"Epoch [{epoch}], Step [{i + 1}], d_loss: {d_loss.item():.4f}, g_loss: {g_loss.item():.4f}")
