"""Tests for megatron.text_generation."""
