"""What a run may be told: the typed schemas of every config group and their range rules, the keys that do not change what a run computes, and user code named by ``_target_``. No torch, no Hydra."""
