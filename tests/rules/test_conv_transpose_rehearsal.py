"""Transposed convolutions in CUDA rehearsal (pytorch/examples dcgan's generator: five
ConvTranspose2d a step, beside the discriminator's Conv2d): counted as GPU convolutions at the
user's line, with their forward FLOPs, so amp-opportunity and cudnn-benchmark see a generator's
work as they see a discriminator's."""
from __future__ import annotations

import pytest

from conftest import audit

pytestmark = pytest.mark.slow

GENERATOR = '''import torch
from torch import nn

device = torch.device("cuda")
torch.manual_seed(0)
gen = nn.Sequential(nn.ConvTranspose2d(64, 32, 4, 2, 1, bias=False), nn.ReLU(),
                    nn.ConvTranspose2d(32, 3, 4, 2, 1, bias=False), nn.Tanh()).to(device)
opt = torch.optim.Adam(gen.parameters(), lr=2e-4)
z = torch.randn(32, 64, 8, 8, device=device)


def step(i):
    opt.zero_grad(set_to_none=True)
    out = gen(z)
    loss = out.pow(2).mean()
    loss.backward()
    opt.step()
'''
STEPS = 6


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    (d / "gen.py").write_text(GENERATOR)
    a = audit("run", f"{d / 'gen.py'}:step", "--steps", str(STEPS), "--no-profile", "--quiet", out=d / "out",
              env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-3000:]
    return d, a


def test_transposed_convolutions_are_counted_with_their_flops(generator):
    d, a = generator
    convs = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "device-matmul"]
    assert {t["what"] for t in convs} == {"conv_transpose2d"}
    assert {t["where"]["line"] for t in convs} == {14}  # `out = gen(z)`, the user's line of the call
    # each input element times Cout/groups x kernel: 32x64x8x8 into 32x4x4, 32x32x16x16 into 3x4x4
    layer1, layer2 = 2 * 32 * 64 * 8 * 8 * (32 * 4 * 4), 2 * 32 * 32 * 16 * 16 * (3 * 4 * 4)
    per_step = {}
    for s in a.evidence["steps"]:
        per_step[s["index"]] = sorted(t["data"]["flops"] for t in s["tallies"] if t["kind"] == "device-matmul")
    assert all(v == sorted([layer1, layer2]) for v in per_step.values()) and len(per_step) == STEPS
    assert {tuple(t["data"]["shape"]) for t in convs} == {(32, 64, 8, 8), (32, 32, 16, 16)}


def test_a_generator_alone_is_an_amp_opportunity_and_wants_the_autotuner(generator):
    d, a = generator
    [amp] = a.rule("amp-opportunity")
    want = 2 * 32 * 64 * 8 * 8 * (32 * 4 * 4) + 2 * 32 * 32 * 16 * 16 * (3 * 4 * 4)
    assert amp["evidence"]["fp32_gflop_per_step"] == round(want / 1e9, 4) and amp["evidence"]["fp32_share"] == 1.0
    [bench] = a.rule("cudnn-benchmark")
    assert bench["evidence"]["convolutions_per_step"] == 2.0
    assert bench["evidence"]["input_shapes"] == [[32, 32, 16, 16], [32, 64, 8, 8]]
    assert {(loc["file"], loc["line"]) for loc in bench["locations"]} == {(str(d / "gen.py"), 14)}
