"""What a recipe optimises: SFT's cross-entropy and DPO's preference objective, behind one interface."""
