"""Records: reading a file's or a hub dataset's records in their format, several sources mixed (and mixed online),
the held-out split, the data's fingerprints and the data report."""
