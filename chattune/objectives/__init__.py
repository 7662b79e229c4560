"""What a recipe optimises: SFT's cross-entropy, DPO's preference objective, KTO's and a reward model's Bradley–Terry loss, behind one interface."""
