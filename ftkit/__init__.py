"""Shared plumbing for the finetuning experiments."""
