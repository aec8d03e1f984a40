"""The shape of eriklindernoren/PyTorch-GAN's implementations (gan.py, cgan.py): the device spelled
with the legacy tensor types, `Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor`,
labels and noise made with them every step, the batch moved with `imgs.type(Tensor)`."""
import numpy as np
import torch
import torch.nn as nn
from torch.autograd import Variable

cuda = True if torch.cuda.is_available() else False
torch.manual_seed(0)
np.random.seed(0)

generator = nn.Sequential(nn.Linear(8 + 4, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 16), nn.Tanh())
discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1), nn.Sigmoid())
label_emb = nn.Embedding(4, 4)
adversarial_loss = torch.nn.BCELoss()
if cuda:
    generator.cuda()
    discriminator.cuda()
    label_emb.cuda()
    adversarial_loss.cuda()

dataset = torch.utils.data.TensorDataset(torch.rand(512, 16) * 2 - 1, torch.randint(0, 4, (512,)))
dataloader = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True)
optimizer_G = torch.optim.Adam(list(generator.parameters()) + list(label_emb.parameters()), lr=2e-4)
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=2e-4)

Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor
LongTensor = torch.cuda.LongTensor if cuda else torch.LongTensor

for epoch in range(3):
    for i, (imgs, labels) in enumerate(dataloader):
        valid = Variable(Tensor(imgs.size(0), 1).fill_(1.0), requires_grad=False)  # VALID LINE
        fake = Variable(Tensor(imgs.size(0), 1).fill_(0.0), requires_grad=False)
        real_imgs = Variable(imgs.type(Tensor))  # TYPE LINE
        assert isinstance(real_imgs, Tensor) and real_imgs.type() == Tensor.__module__ + ".FloatTensor"

        optimizer_G.zero_grad()
        z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0], 8))))  # NOISE LINE
        gen_labels = Variable(LongTensor(np.random.randint(0, 4, imgs.shape[0])))  # LABELS LINE
        gen_imgs = generator(torch.cat((z, label_emb(gen_labels)), -1))
        g_loss = adversarial_loss(discriminator(gen_imgs), valid)
        g_loss.backward()
        optimizer_G.step()

        optimizer_D.zero_grad()
        real_loss = adversarial_loss(discriminator(real_imgs), valid)
        fake_loss = adversarial_loss(discriminator(gen_imgs.detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        d_loss.backward()
        optimizer_D.step()
        print("[Epoch %d] [Batch %d/%d] [D loss: %f] [G loss: %f]" % (epoch, i, len(dataloader), d_loss.item(), g_loss.item()))
