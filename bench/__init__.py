"""``kvchat bench``: quality, speed and memory of every policy, measured by the project itself.

One module per benchmark (ppl, recall, speed, memory, headaware, kvpress), each with ``add_arguments``,
``QUICK`` sizes, ``run``, ``plot`` and ``markdown``; ``cli`` runs them and ``report`` writes docs/RESULTS.md.
"""
