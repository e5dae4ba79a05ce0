"""Make this Python look like the lent GPU machine's image: the packages it lacks cannot be imported.

    PYTHONPATH=benchmarks/gpu_image python3 -m benchmarks.gpu_all --smoke   # rehearse the GPU shot

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that holds one, so
putting this folder on PYTHONPATH is enough (gpu_all's steps keep the PYTHONPATH they are given).
The image (the device tool's page) has torch, torchvision, scikit-learn, scipy, matplotlib, rich,
pillow, pytest, pytest-timeout, pytest-xdist, timm and transformers; gpu_all carries hydra-core,
omegaconf and antlr4 as wheels. It has nothing that mptrain's ``test`` extra adds beyond those, and
what it has of the extra may change, so everything optional is blocked here, timm and transformers
included: a GPU test file or script that needs one must skip, not fail to import.

A blocked name is set to ``None`` in ``sys.modules``: ``import torchao`` then raises
ModuleNotFoundError (an ImportError, what ``pytest.importorskip`` catches) and
``importlib.util.find_spec("torchao")`` returns None, as on a machine without it.
"""

import os
import sys

LACKS = (
    "torchao", "timm", "transformers", "tokenizers", "mlflow", "tensorboard", "optuna",
    "pyarrow", "lightning", "accelerate", "submitit",
    "hydra_plugins.hydra_joblib_launcher", "hydra_plugins.hydra_optuna_sweeper",
    "hydra_plugins.hydra_submitit_launcher",
)  # fmt: skip

for _name in LACKS:
    sys.modules[_name] = None  # type: ignore[assignment]  # "not installed", for import and find_spec

if os.environ.get("GPU_IMAGE_VERBOSE"):
    print(f"gpu_image: blocked {', '.join(LACKS)}", file=sys.stderr)
