"""``python -m mptrain``: the same Hydra app as the ``mptrain`` console script."""

from mptrain.cli.app import main

if __name__ == "__main__":
    main()
