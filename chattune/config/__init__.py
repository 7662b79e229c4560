"""Configs: where the shipped ones are (`paths`) the schema of every key (`schema`) and the layout rules that `chattune validate` and the runtime share (`layout_rules`); nothing above them."""
