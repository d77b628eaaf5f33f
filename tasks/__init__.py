"""Downstream evaluation tasks run by tasks/main.py (Megatron layout: tasks/<task family>/...)."""
