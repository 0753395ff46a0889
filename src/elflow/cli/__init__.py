"""The command line: one module per command (``add_arguments(parser)`` and ``run(args)``), shared
flags in :mod:`elflow.cli.common`. The only place that imports argparse; the library never
imports it. Modules here import torch and transformers only inside ``run``, so ``--help``
answers at once.
"""
