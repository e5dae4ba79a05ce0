"""How a run computes: the precision policy (autocast, loss scaling, TF32, FP32 islands), FP8 layers and their distributed state, and numerics diagnostics."""
