"""What a run costs: its model FLOPs (MFU), and the memory estimate of a rank with the advice that fits a run (its
inputs, the activation trace)."""
