"""``kvchat bench``: quality, speed and memory of every policy, measured by the project itself.

One module per benchmark (ppl, recall, speed, memory, headaware, kvpress, chat, durability; speed_cuda for
``speed --device cuda``), each with ``QUICK`` sizes, ``run``, ``plot`` and ``markdown`` (and ``add_arguments``);
``cli`` runs them and ``report`` writes docs/RESULTS.md.
"""

HELP = "measure quality, speed and memory of every policy (JSON, plots, report)"  # ``kvchat --help``'s line
