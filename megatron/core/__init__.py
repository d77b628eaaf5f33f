"""Parallelism core: process groups, tensor/pipeline-parallel building blocks, DDP. Never imports training,
arguments or global_vars; everything it needs arrives as arguments (process groups, config objects)."""
