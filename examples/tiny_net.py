"""A small custom model for mptrain: ``model=custom model._target_=tiny_net.TinyNet``.

mptrain passes ``in_channels`` and ``num_classes`` from the dataset (the constructor names them);
``width`` comes from the command line (``+model.width=32``).
"""

from torch import nn


class TinyNet(nn.Module):
    """Conv -> ReLU -> global average pool -> Linear: (batch, C, H, W) images to class logits."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, images):
        return self.head(self.features(images))
