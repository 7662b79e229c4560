"""Launching a recipe: composing its config as Hydra does (`compose`), checking every key and rule at once
(`schema_checks`, `run_rules`, reported by `findings`; `validate` for `chattune validate` and each recipe's
start-up; `memory_plan` for its memory estimate), and the Hydra app a recipe runs in (`app`)."""
