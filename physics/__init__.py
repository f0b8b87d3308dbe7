"""meshtrain.physics: the facts training and planning both count with, and nothing else.

    gpus.py    the GPUs meshtrain knows (peak compute, memory, links, the headroom rule)
    flops.py   training FLOPs per token (what MFU is measured in)

It imports no other part of meshtrain and no torch: training reports MFU from it, the
planner estimates from it, and neither has to import the other (tests/test_imports.py).
"""
