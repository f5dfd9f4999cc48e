"""Short convergence check of the fp8_blockwise recipe: a small MoE MLP regression trained with
AdamW for 300 steps tracks the bf16 loss curve within 2% (mean loss over each 50-step window,
averaged over three initializations).

One initialization is not enough to tell the recipe from luck: the last window's gap per seed
(0, 1, 2) was 1.1 / 2.4 / 0.4% in the CPU emulation and 2.4 / 0.4 / 0.4% on the H100 kernels
(the emulation on the same H100: 1.9 / -0.1 / 0.1%); averaged over the seeds 1.3% and 1.1%.

Runs the torch emulation on the CPU (CI) and the sm90 kernels on a Hopper GPU (marked gpu).
"""

import pytest
import torch

from te_fused_ops import GroupedLinear, Quantize, Sequential, SwiGLU, Transpose

G, H, I, ROWS, STEPS, WINDOW = 4, 256, 128, 512, 300, 50


SEEDS = (0, 1, 2)


def model(fp8: bool, device, seed: int):
    torch.manual_seed(seed)
    fc1 = GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16, device=device)
    fc2 = GroupedLinear(G, I, H, dtype=torch.bfloat16, device=device)
    if fp8:
        return Sequential(Quantize("fp8_blockwise"), fc1, SwiGLU(), Quantize("fp8_blockwise"), Transpose(), fc2)
    return Sequential(fc1, SwiGLU(), fc2)


def loss_curve(fp8: bool, device, seed: int):
    """Per-step losses of a student (initialized from ``seed``) fitting a fixed random teacher on
    fresh batches (the same batches and routing for both recipes and every seed)."""
    student = model(fp8, device, seed)
    gen = torch.Generator(device="cpu").manual_seed(1)
    teacher_w1 = torch.randn(G, 2 * I, H, generator=gen).to(device) / H**0.5
    teacher_w2 = torch.randn(G, H, I, generator=gen).to(device) / I**0.5
    opt = torch.optim.AdamW(student.parameters(), lr=5e-3, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        x = torch.randn(ROWS, H, generator=gen).to(device)
        splits = torch.multinomial(torch.ones(G), ROWS, replacement=True, generator=gen).bincount(minlength=G)
        with torch.no_grad():
            target, start = torch.zeros_like(x), 0
            for g, size in enumerate(splits.tolist()):
                rows = slice(start, start + size)
                gate, up = (x[rows] @ teacher_w1[g].T).chunk(2, dim=-1)
                target[rows] = (torch.nn.functional.silu(gate) * up) @ teacher_w2[g].T
                start += size
        y = student(x.to(torch.bfloat16), split_sizes=splits.to(device))
        loss = torch.nn.functional.mse_loss(y.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def window_means(fp8: bool, device):
    """Mean loss per 50-step window, averaged over the seeds."""
    return torch.stack([loss_curve(fp8, device, seed).view(-1, WINDOW).mean(1) for seed in SEEDS]).mean(0)


def check_tracks_bf16(device):
    bf16_windows, fp8_windows = window_means(False, device), window_means(True, device)
    assert bf16_windows[-1] < 0.6 * bf16_windows[0], f"bf16 did not learn: {bf16_windows.tolist()}"
    gap = ((fp8_windows - bf16_windows).abs() / bf16_windows).max().item()
    assert gap <= 0.02, f"fp8 vs bf16 window means differ by {gap:.1%}: {fp8_windows.tolist()} vs {bf16_windows.tolist()}"


def test_fp8_blockwise_tracks_bf16_emulated_on_cpu():
    check_tracks_bf16("cpu")


@pytest.mark.gpu
def test_fp8_blockwise_tracks_bf16_on_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 backend needs a Hopper GPU")
    check_tracks_bf16("cuda")
