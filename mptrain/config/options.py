"""Every option a config group offers, by name, with the schema it takes: what a user may type
after ``model=``, ``dataset=``, ``optimizer=``, ``scheduler=`` and ``precision=`` (and the other
tools' names a precision also answers to, :data:`PRECISION_ALIASES`).

Composing a config (``mptrain --help``, ``--cfg job``, the preflight) needs only these names and
schemas, not the builders: this module imports no torch. The builder tables
(:data:`mptrain.models.build.MODELS`, :data:`mptrain.data.build.DATASETS`,
:data:`mptrain.train.optim.OPTIMIZERS`, :data:`mptrain.train.optim.SCHEDULES`,
:data:`mptrain.precision.policy.PRECISIONS`) pair each name with what builds it;
tests/config/test_config.py keeps both lists, and ``conf/<group>/<option>.yaml``, in step.
"""

from __future__ import annotations

from mptrain.config.data import (
    CustomDatasetConfig,
    DigitsConfig,
    ImageFolderConfig,
    SyntheticConfig,
    TextDatasetConfig,
    TorchvisionDatasetConfig,
)
from mptrain.config.models import (
    CNNConfig,
    CustomModelConfig,
    GPTConfig,
    HFModelConfig,
    MLPConfig,
    ResNetConfig,
    TimmModelConfig,
    TorchvisionModelConfig,
    ViTConfig,
)
from mptrain.config.optim import AdamWConfig, LowBitAdamWConfig, SchedulerConfig, SGDConfig
from mptrain.config.precision import PrecisionConfig

AUTO = "auto"  # precision=auto: resolved for the device (mptrain.precision.policy)
PRECISION_NAMES = (
    "fp32",
    "fp16",
    "bf16",
    "fp8",
    "mxfp8",
    "nvfp4",
    "fp16_noscale",
    "fp16_pure",
    "bf16_pure",
)
# PyTorch Lightning's precision names (Trainer(precision=...)), typed by habit: each is an option
# of its own, conf/precision/<alias>.yaml, which selects the precision it names and records the
# alias (precision.alias), so the report says what was asked for and what ran.
PRECISION_ALIASES = {
    "32-true": "fp32",
    "16-mixed": "fp16",
    "bf16-mixed": "bf16",
    "16-true": "fp16_pure",
    "bf16-true": "bf16_pure",
    "transformer-engine": "fp8",
}

SCHEMAS: dict[str, dict[str, type]] = {
    "precision": {name: PrecisionConfig for name in (AUTO, *PRECISION_NAMES)},
    "model": {
        "mlp": MLPConfig,
        "cnn": CNNConfig,
        "resnet18": ResNetConfig,
        "resnet50": ResNetConfig,
        "vit": ViTConfig,
        "gpt": GPTConfig,
        "torchvision": TorchvisionModelConfig,
        "timm": TimmModelConfig,
        "custom": CustomModelConfig,
        "hf": HFModelConfig,
    },
    "dataset": {
        "digits": DigitsConfig,
        "synthetic": SyntheticConfig,
        "cifar10": TorchvisionDatasetConfig,
        "cifar100": TorchvisionDatasetConfig,
        "mnist": TorchvisionDatasetConfig,
        "fashion_mnist": TorchvisionDatasetConfig,
        "imagefolder": ImageFolderConfig,
        "custom": CustomDatasetConfig,
        "text": TextDatasetConfig,
    },
    "optimizer": {
        "sgd": SGDConfig,
        "adamw": AdamWConfig,
        **{name: LowBitAdamWConfig for name in ("adamw8bit", "adamw4bit", "adamw_fp8")},
    },
    "scheduler": {name: SchedulerConfig for name in ("constant", "cosine", "multistep")},
}
