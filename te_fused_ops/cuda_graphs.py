"""Whole training steps as one CUDA graph: capture once, replay with new routing.

Every te_fused_ops path is sync-free with ``split_sizes`` on the GPU and its launches depend on
shapes only, so a step's forward and backward can be captured once over static tensors and
replayed; routing changes by writing new values into the same ``split_sizes`` tensor. Two
settings read values on the host and are refused during a capture: value checks
(``TE_FUSED_OPS_VALIDATE=1``) and a dropless expert-parallel `Permute` (``capacity_factor=None``).
"""

import torch


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class CudaGraphStep:
    """``step()`` (forward + backward over static tensors, gradients set to None inside) captured
    as one CUDA graph; calling the object replays it and returns what ``step`` returned at capture.

        x, split_sizes = static input tensors (fill them before each replay)
        def step():
            for p in model.parameters():
                p.grad = None
            loss = model(x, split_sizes=split_sizes).float().square().mean()
            loss.backward()
            return loss
        graphed = CudaGraphStep(step)
        for batch, routing in loader:
            x.copy_(batch); split_sizes.copy_(routing)
            loss = graphed()             # gradients are in p.grad (static tensors) after this
            optimizer.step()             # outside the graph (or capture it in ``step`` too)

    ``warmup`` eager runs on a side stream first compile kernels and torch.compile'd code and let
    autograd allocate; they change gradients and anything ``step`` updates, like the replays. Under
    `cast_weights_once_per_step` they also make the FP8 weight copies the graph reads, which each
    optimizer step recasts in place.

    - Every replay returns the same tensors (copy a loss out to keep it); the gradients are the
      graph's tensors: ``optimizer.zero_grad()`` with its default ``set_to_none=True`` between
      replays detaches them, and later replays write where no optimizer reads.
    - Gradient accumulation: leave ``p.grad = None`` out of ``step`` (inside it, each replay would
      overwrite the last micro-batch's gradient), zero in place (``zero_grad(set_to_none=False)``)
      after each optimizer step and replay once per micro-batch (README, FP8 recipes).
    - A router's ``aux_loss`` and ``tokens_per_expert`` are the tensors the capture made, written
      by each replay until an eager call binds new ones; its ``aux_loss_coeff`` is the value at
      capture.
    - The optimizer step captured in ``step`` too runs no step hooks at replays: eager calls
      between replays then read the weight copies of before (call ``drop()`` on what
      `cast_weights_once_per_step` returned first). Under autocast the weights are cast in the
      graph at every replay (their autocast copies are new at every call).
    """

    def __init__(self, step, warmup: int = 2, pool=None):
        if not callable(step):
            raise TypeError(f"CudaGraphStep: argument 'step' must be callable, got {type(step).__name__}")
        if not torch.cuda.is_available():
            raise RuntimeError("CudaGraphStep: CUDA graphs need a CUDA device")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = step()

    def __call__(self):
        self.graph.replay()
        return self.output
