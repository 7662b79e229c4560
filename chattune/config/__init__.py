"""Configs: where the shipped ones are (`paths`) and the schema of every key (`schema`); nothing above them."""
