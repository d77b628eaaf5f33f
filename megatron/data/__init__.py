"""Datasets: indexed .bin/.idx token files, GPT/blended datasets, samplers and the C++ index helpers."""
