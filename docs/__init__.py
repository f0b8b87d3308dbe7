"""The docs that are generated from code live next to the hand-written ones: see generate.py."""
