"""What tests share besides fixtures (those, and the tiers' collection hook, stay in conftest.py):
``from support.runs import tiny_run``. tests/README.md lists the modules."""
