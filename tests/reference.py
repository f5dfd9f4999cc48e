"""Float64 references for the ops, written independently of the library (autograd for grads)."""

import torch
import torch.nn.functional as F


def rel_err(out, ref) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float64: 1e-12}


def grouped_linear(x, weight, bias, splits):
    """x (M, K), weight (G, N, K), python list of sizes; rows past sum(splits) are zero."""
    y = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for g, size in enumerate(splits):
        size = max(0, min(size, x.shape[0] - start))
        rows = slice(start, start + size)
        y[rows] = x[rows] @ weight[g].t() + (bias[g] if bias is not None else 0)
        start += size
    return y


def swiglu(x):
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def geglu(x):
    gate, up = x.chunk(2, -1)
    return F.gelu(gate, approximate="tanh") * up


def srelu(x):
    return torch.relu(x) ** 2


def clamped_swiglu(x, limit=7.0, alpha=1.702):
    gate, up = x.chunk(2, -1)
    g = gate.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (up.clamp(-limit, limit) + 1)


def scaled_swiglu(x, probs):
    return swiglu(x) * probs.unsqueeze(-1)


def moe_layer(x, indices, probs, w1, w2, act=swiglu):
    """The MoE layer slot by slot: ``sum_j probs[t, j] * act(x[t] @ w1[e].T) @ w2[e].T`` over the
    slots of token t whose expert e = indices[t, j] is in [0, E) (others are dropped)."""
    num_experts = w1.shape[0]
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for j in range(indices.shape[1]):
        for e in range(num_experts):
            tokens = (indices[:, j] == e).nonzero().flatten()
            if tokens.numel():
                y = act(x[tokens] @ w1[e].t()) @ w2[e].t()
                out = out.index_add(0, tokens, probs[tokens, j, None] * y)
    return out


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs, parameters excluded."""
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())
