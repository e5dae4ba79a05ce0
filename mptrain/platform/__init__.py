"""What the machine gives a run: device and software facts, seeding, torchrun process groups, signals and dtype names."""
