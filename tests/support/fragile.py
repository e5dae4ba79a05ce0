"""A model with a layer that low precision breaks, importable by ``model=custom``: the fragile
models advise's per-layer and per-GEMM plans are tested on (tests/commands/test_advise_plan.py,
tests/perf/test_roofline_gemms.py; the ``fragile_module`` fixture of tests/conftest.py writes
it where ``model._target_=fragile_net.<class>`` finds it)."""

FRAGILE = '''
import torch
from torch import nn

SPIKE = 1e7


def add_fragile_body(model: nn.Module) -> None:
    """Three FP8-eligible Linear layers, a, fragile, b. ``fragile``'s input carries a constant
    spike of 1e7 on channel 0 (a "massive activation") that the layer ignores: its weights'
    column 0 is zero and stays zero (its gradient is masked). FP32 and BF16 compute what the layer
    would without the spike; tensorwise FP8 scales the whole input by 448 / 1e7 and every other
    channel flushes to zero, so nothing but the bias comes out."""
    model.a = nn.Linear(64, 64)
    model.fragile = nn.Linear(64, 64)
    model.b = nn.Linear(64, 64)
    spike = torch.zeros(64)
    spike[0] = SPIKE
    model.register_buffer("spike", spike)
    mask = torch.ones(64, 64)
    mask[:, 0] = 0
    with torch.no_grad():
        model.fragile.weight.mul_(mask)
    model.fragile.weight.register_hook(lambda grad: grad * mask)


def fragile_body(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    h = model.fragile(model.a(h).relu() + model.spike).relu()
    return model.b(h).relu()


class FragileNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.stem = nn.Linear(in_channels * 64, 64)  # first and last: kept by keep_first_last
        add_fragile_body(self)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.head(fragile_body(self, self.stem(self.flatten(x)).relu()))


class FragileLM(nn.Module):
    def __init__(self, vocab_size: int, block_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 64)
        add_fragile_body(self)
        self.head = nn.Linear(64, vocab_size)  # task=lm's fp8.exclude keeps it

    def forward(self, ids):
        return self.head(fragile_body(self, self.embed(ids)))
'''
