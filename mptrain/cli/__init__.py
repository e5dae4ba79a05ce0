"""The command line: how ``mptrain ...`` becomes checked, typed runs; the only Hydra/OmegaConf
code. What each of its modules holds: ARCHITECTURE.md, layer 8."""
