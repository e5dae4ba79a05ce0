# Marks conf/ as the package mptrain.conf so the wheel ships these YAML files (see pyproject.toml).
