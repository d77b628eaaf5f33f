"""GLUE finetuning tasks (MNLI, QQP)."""
