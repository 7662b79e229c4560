"""On-policy distillation's teacher (`chattune.train.reference.teacher_model`): a directory whose tokenizer differs
from the student's is refused naming the difference; for loss.type=gkd, which compares whole distributions, so is an
output layer of other rows, and the remedy the message names (loss.type=reverse_kl) takes that teacher."""

from __future__ import annotations

import pytest
from test_validate import compose_config

from chattune.errors import UserError
from chattune.launch.recipe_kinds import GRPO
from chattune.launch.validate import checked_config
from chattune.model.causal_lm import PackedCausalLM, build_hf_model
from chattune.train.reference import teacher_model
from conftest import demo_tokenizer, mesh_dims, tiny_config, tiny_model


def config(student_dir, teacher_dir, loss_type: str):
    overrides = [f"model.path={student_dir}", f"teacher.path={teacher_dir}", f"loss.type={loss_type}"]
    return checked_config(compose_config("grpo/tiny", [*overrides, "reward.functions=[]"]), GRPO)[0]


def test_a_teacher_of_other_output_rows_is_refused_for_gkd_and_taken_by_reverse_kl(one_rank_group, tmp_path, base_dir):
    tokenizer = demo_tokenizer()
    wide = tmp_path / "wide"
    build_hf_model(tokenizer, tiny_config(), vocab_size=len(tokenizer) + 8).save_pretrained(wide)
    tokenizer.save_pretrained(wide)
    student = PackedCausalLM(tiny_model())
    with pytest.raises(UserError, match=rf"its output layer has {len(tokenizer) + 8} rows and the student's "):
        teacher_model(config(base_dir, wide, "gkd"), tokenizer, mesh_dims(), student)
    teacher = teacher_model(config(base_dir, wide, "reverse_kl"), tokenizer, mesh_dims(), student)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training


def test_a_teacher_with_another_tokenizer_is_refused_naming_the_difference(one_rank_group, tmp_path, base_dir):
    tokenizer = demo_tokenizer()
    other = tmp_path / "other"
    tiny_model().save_pretrained(other)
    changed = demo_tokenizer()
    changed.add_tokens(["<teacher_only>"])
    changed.save_pretrained(other)
    with pytest.raises(UserError, match=r"its tokenizer differs from the student's .*<teacher_only>"):
        teacher_model(config(base_dir, other, "reverse_kl"), tokenizer, mesh_dims(), PackedCausalLM(tiny_model()))
