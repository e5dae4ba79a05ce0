"""The only layer that speaks Hydra/OmegaConf: schema registration, the preflight of every job, and the launch."""
