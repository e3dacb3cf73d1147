"""Techniques: each family has a cost face (predict memory/time) and an apply face (do it)."""
