"""The `chattune` command: ls, cp, validate, inspect, prepare, plot, chat, run."""
