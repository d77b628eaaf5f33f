"""RACE multiple-choice finetuning."""
