"""Data: records → conversations → chat-template documents with shifted labels → packed (1, N) batches."""
