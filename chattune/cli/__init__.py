"""The `chattune` command: ls, cp, validate, inspect, plot."""
