"""Training of trained drafters (dflash, mtp): data by self-distillation, then the trainer."""
