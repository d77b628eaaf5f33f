"""Tests for tasks/ (zero-shot evaluation)."""
