# Marks recipes/ as the package mptrain.recipes so the wheel ships the recipes (see pyproject.toml).
