"""Configs: where the shipped ones are, the schema of every key, validation, and a recipe's Hydra app."""
