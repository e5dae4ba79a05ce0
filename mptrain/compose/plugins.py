"""Hydra's launcher and sweeper plugins by the option that selects them, and the package that
installs each: ``hydra/launcher=joblib`` without hydra-joblib-launcher installed is answered with
what to install, not with "choose one of basic" (Hydra lists only the plugins it finds)."""

from __future__ import annotations

import re

# (group, option) -> the PyPI package that provides it (the plugins of Hydra's own repository).
PLUGIN_PACKAGES = {
    ("hydra/launcher", "joblib"): "hydra-joblib-launcher",
    ("hydra/launcher", "submitit_local"): "hydra-submitit-launcher",
    ("hydra/launcher", "submitit_slurm"): "hydra-submitit-launcher",
    ("hydra/launcher", "ray"): "hydra-ray-launcher",
    ("hydra/launcher", "ray_aws"): "hydra-ray-launcher",
    ("hydra/launcher", "rq"): "hydra-rq-launcher",
    ("hydra/sweeper", "optuna"): "hydra-optuna-sweeper",
    ("hydra/sweeper", "ax"): "hydra-ax-sweeper",
    ("hydra/sweeper", "nevergrad"): "hydra-nevergrad-sweeper",
}
# Extras that bundle everything for working on mptrain, not a feature a user would ask for.
_DEVELOPER_EXTRAS = ("test", "dev")


def missing_plugin_hint(group: str, option: str) -> str | None:
    """What to install for ``group=option`` when it names a plugin Hydra did not find: the
    package, and mptrain's extra that installs it where there is one; None for any other option."""
    package = PLUGIN_PACKAGES.get((group, option))
    if package is None:
        return None
    kind = group.removeprefix("hydra/")
    hint = f"{group}={option}: Hydra's {option} {kind} is not installed; pip install {package}"
    extra = _extra_installing(package)
    return f'{hint} (or pip install "mptrain[{extra}]")' if extra else hint


def _extra_installing(package: str) -> str | None:
    """The extra of the installed mptrain whose requirements name ``package`` (developer extras
    left out), from the package's metadata (pyproject.toml's optional-dependencies)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        requirements = requires("mptrain") or []
    except PackageNotFoundError:  # run from a source tree that was never installed
        return None
    for requirement in requirements:
        name = re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0]
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if name.lower() == package and extra and extra[1] not in _DEVELOPER_EXTRAS:
            return extra[1]
    return None
