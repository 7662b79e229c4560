"""From records to documents: the tokenizer and its chat template (chosen, probed), each recipe's documents with
assistant-only labels (SFT's, preference pairs', KTO's), prompts, and text encoding."""
